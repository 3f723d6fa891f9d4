"""What a CRM judges: criteria, a query and two conversations with a label (`PairExample`).

The one type that data, inference, evaluation and leaderboards share; training's transforms
(crm/data/transforms.py) build it from training records, `eval_example` from test records.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from crm.core.records import Conversation, TestRecord

LABEL_A, LABEL_B, LABEL_TIE = 0, 1, 2
LABELS = {"model_a": LABEL_A, "model_b": LABEL_B, "tie": LABEL_TIE}


def verdict(probs: Sequence[float]) -> int | None:
    """The label with the highest probability; None when the top two are equal (a score tie)."""
    if any(p != p for p in probs):  # NaN: the pair could not be scored
        return None
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
    return None if probs[ranked[0]] == probs[ranked[1]] else ranked[0]


@dataclass(frozen=True)
class PairExample:
    """What the model sees: criteria, a query and two conversations (after the query); the label."""

    key: str
    criteria: tuple[str, ...]
    query: str
    conv_a: Conversation
    conv_b: Conversation
    label: int  # LABEL_A, LABEL_B or LABEL_TIE
    topic: str | None = None


def after_query(conversation: Conversation) -> Conversation:
    """The messages after the query (the first message): what a slot of the prompt shows."""
    return conversation[1:]


def swap(example: PairExample) -> PairExample:
    label = {LABEL_A: LABEL_B, LABEL_B: LABEL_A}.get(example.label, example.label)
    return PairExample(example.key, example.criteria, example.query, example.conv_b, example.conv_a,
                       label, example.topic)


def eval_example(record: TestRecord, swapped: bool = False) -> PairExample:
    """A test record as the model sees it; `swapped=True` gives the B/A order."""
    # The query comes from the conversation, as in training; `prompt` is the file's own copy of it.
    example = PairExample(record.idx, record.criteria, record.model_a[0].content,
                          after_query(record.model_a),
                          after_query(record.model_b), LABELS[record.preference], record.topic)
    return swap(example) if swapped else example
