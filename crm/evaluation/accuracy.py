"""Accuracy of a CRM on test files (docs/DESIGN.md section 8): strict, in both orders, with flip and
tie rates."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from crm.core.examples import LABEL_A, LABEL_B, LABEL_TIE, eval_example, verdict
from crm.core.records import TestRecord, load_records
from crm.inference.scorer import unswap

VERDICT_NAMES = {LABEL_A: "model_a", LABEL_B: "model_b", LABEL_TIE: "tie", None: "score_tie"}


def verdict_name(probs: list[float]) -> str:
    """A prediction's verdict; "unscorable" (not a score tie) for a pair too long to fit."""
    return "unscorable" if any(p != p for p in probs) else VERDICT_NAMES[verdict(probs)]


def _rate(xs: list[bool]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def accuracy_metrics(labels: list[int], given: torch.Tensor, swapped: torch.Tensor,
                     topics: list[str | None]) -> dict:
    """`given` and `swapped` are (n, 3) P(A), P(B), P(tie) in the A/B order of the file.

    Strict: a score tie is wrong. `accuracy_mean` is the mean of the two orders' accuracies;
    `accuracy_both_orders` judges the averaged probabilities (the scorer's `both_orders`). The
    flip rate is the share of records whose verdict changes when A and B are swapped (a
    position-biased judge flips); the tie rate the share of verdicts, in both orders, that are a
    score tie or the tie class, among the pairs that could be scored (an unscorable pair, too
    long to fit, has no verdict: it is counted `unscorable` and wrong, not a tie).
    """
    n = len(labels)
    scorable = [not bool(torch.isnan(g).any() or torch.isnan(s).any())
                for g, s in zip(given, swapped)]
    v_given = [verdict(p.tolist()) for p in given]
    v_swapped = [verdict(p.tolist()) for p in swapped]
    ok_given = [v == y for v, y in zip(v_given, labels)]
    ok_swapped = [v == y for v, y in zip(v_swapped, labels)]
    ok_both = [verdict(p.tolist()) == y for p, y in zip((given + swapped) / 2, labels)]
    metrics = {
        "n": n,
        "accuracy": _rate(ok_given),
        "accuracy_swapped": _rate(ok_swapped),
        "accuracy_mean": _rate(ok_given + ok_swapped),
        "accuracy_both_orders": _rate(ok_both),
        "flip_rate": _rate([a != b for a, b in zip(v_given, v_swapped)]),
        "tie_rate": _rate([v in (None, LABEL_TIE) for v, ok in zip(v_given + v_swapped, scorable * 2)
                           if ok]),
        "gold_ties": sum(y == LABEL_TIE for y in labels),
        "unscorable": scorable.count(False),  # too long to fit; counted as wrong
    }
    by_topic = defaultdict(list)
    for topic, a, b in zip(topics, ok_given, ok_swapped):
        if topic is not None:
            by_topic[topic].append((a, b))
    if by_topic:
        metrics["by_topic"] = {
            t: {"n": len(v), "accuracy": _rate([a for a, _ in v]),
                "accuracy_swapped": _rate([b for _, b in v]),
                "accuracy_mean": _rate([x for pair in v for x in pair])}
            for t, v in sorted(by_topic.items())}
    return metrics


def evaluate_records(scorer, records: Sequence[TestRecord]) -> tuple[dict, list[dict]]:
    """(metrics, one prediction dict per record) for a CRMScorer on test records."""
    labels = [eval_example(r).label for r in records]
    shortened_before = scorer.counts.get("shortened", 0)
    given = scorer.pair_probabilities([eval_example(r) for r in records], unfit="nan")
    shortened = scorer.counts.get("shortened", 0) - shortened_before
    if scorer.kind == "pointwise":
        # sigmoid(r_a - r_b) of rewards that do not depend on the order: the swap is exact.
        swapped = given.clone()
    else:
        swapped = unswap(scorer.pair_probabilities([eval_example(r, swapped=True) for r in records],
                                                   unfit="nan"))
    metrics = accuracy_metrics(labels, given, swapped, [r.topic for r in records])
    # Prompts cut to fit, given order (a pointwise CRM's: responses): judged, but on less text.
    metrics["shortened"] = shortened
    predictions = [
        {"idx": r.idx, "topic": r.topic, "preference": r.preference,
         "p_given": [round(x, 6) for x in g.tolist()], "p_swapped": [round(x, 6) for x in s.tolist()],
         "verdict": verdict_name(g.tolist()), "verdict_swapped": verdict_name(s.tolist())}
        for r, g, s in zip(records, given, swapped)
    ]
    return metrics, predictions


def evaluate_files(scorer, paths) -> tuple[dict, dict]:
    """({path: metrics}, {path: predictions}) for test-format files."""
    metrics, predictions = {}, {}
    for path in paths:
        metrics[str(path)], predictions[str(path)] = evaluate_records(scorer, load_records(path, "test"))
    return metrics, predictions
