"""CRMScorer: batched inference with a trained CRM, no trainer needed."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from crm.data.stream import pad_rows
from crm.models.crm import last_token_logits
from crm.models.export import load_export
from crm.prompts import PromptEncoder, PromptTemplate
from crm.records import Conversation, Message
from crm.transforms import PairExample


def default_device_dtype() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def as_conversation(response: str | Conversation) -> Conversation:
    """A response after the query: plain text is one assistant message."""
    if isinstance(response, str):
        return (Message("assistant", response),)
    return tuple(response)


class CRMScorer:
    """Compares responses under criteria: `compare_many` gives P(A preferred) per pair.

    A pairwise model reads both responses in one sequence; a pointwise model scores each and
    compares with a sigmoid of the reward difference. Prompts that the length policy cannot fit are
    refused with an error (a score must never silently disappear).
    """

    def __init__(self, model, tokenizer, template: PromptTemplate, kind: str, max_tokens: int,
                 batch_size: int = 16, device: torch.device | None = None):
        self.model, self.tokenizer, self.kind = model.eval(), tokenizer, kind
        self.encoder = PromptEncoder(tokenizer, template, max_tokens)
        self.batch_size = batch_size
        self.device = device or next(model.parameters()).device
        self.num_labels = model.config.num_labels

    @classmethod
    def from_export(cls, export_dir: str | Path, batch_size: int = 16, device=None, dtype=None):
        auto_device, auto_dtype = default_device_dtype()
        model, tokenizer, template, meta = load_export(export_dir, dtype=dtype or auto_dtype)
        model.to(device or auto_device)
        return cls(model, tokenizer, template, meta["kind"], meta["max_tokens"], batch_size)

    @torch.inference_mode()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        out = []
        for i in range(0, len(rows), self.batch_size):
            batch = pad_rows(rows[i:i + self.batch_size], self.tokenizer.pad_token_id)
            out.append(last_token_logits(self.model, batch["input_ids"].to(self.device),
                                         batch["attention_mask"].to(self.device)).float().cpu())
        return torch.cat(out) if out else torch.empty(0, max(self.num_labels, 1))

    def _checked(self, encoded: list, what: str) -> list[list[int]]:
        if any(ids is None for ids in encoded):
            raise ValueError(f"{sum(i is None for i in encoded)} {what} cannot fit in "
                             f"{self.encoder.max_tokens} tokens even with shortened responses")
        return encoded

    def _fitting(self, encoded: list) -> tuple[list[list[int]], torch.Tensor]:
        """The rows that fit and a mask of which did."""
        fits = torch.tensor([ids is not None for ids in encoded], dtype=torch.bool)
        return [ids for ids in encoded if ids is not None], fits

    def pair_probabilities(self, examples: Sequence[PairExample], unfit: str = "raise") -> torch.Tensor:
        """(n, 3): P(A), P(B), P(tie) per example (P(tie) = 0 without a tie class).

        A pair that cannot fit `max_tokens` raises, or with unfit="nan" gets a row of NaN (an
        evaluation counts it as wrong and reports how many there were).
        """
        if self.kind == "pointwise":
            rewards = self._rewards([(e.criteria, e.query, c) for e in examples
                                     for c in (e.conv_a, e.conv_b)], unfit)
            p_a = torch.sigmoid(rewards[0::2] - rewards[1::2])
            return torch.stack([p_a, 1 - p_a, torch.zeros_like(p_a)], dim=1)
        encoded = self.encoder.pairwise_many([(e.criteria, e.query, e.conv_a, e.conv_b) for e in examples])
        if unfit == "raise":
            self._checked(encoded, "pairs")
        rows, fits = self._fitting(encoded)
        probs = torch.full((len(examples), 3), float("nan"))
        scored = self._logits(rows).softmax(-1)
        probs[fits, :scored.shape[1]] = scored
        if scored.shape[1] == 2:
            probs[fits, 2] = 0.0
        return probs

    def _rewards(self, items: Sequence[tuple], unfit: str) -> torch.Tensor:
        encoded = self.encoder.pointwise_many(list(items))
        if unfit == "raise":
            self._checked(encoded, "responses")
        rows, fits = self._fitting(encoded)
        rewards = torch.full((len(items),), float("nan"))
        rewards[fits] = self._logits(rows).squeeze(-1)
        return rewards

    def score_many(self, items: Sequence[tuple]) -> torch.Tensor:
        """Pointwise rewards for [(criteria, query, conversation)]."""
        if self.kind != "pointwise":
            raise ValueError("score_many needs a pointwise CRM; a pairwise CRM compares pairs")
        return self._rewards(items, "raise")

    def compare(self, criteria: Sequence[str], query: str, a, b) -> float:
        """Probability that response `a` is preferred to `b` under `criteria`."""
        example = PairExample("", tuple(criteria), query, as_conversation(a), as_conversation(b), 0)
        return float(self.pair_probabilities([example])[0, 0])
