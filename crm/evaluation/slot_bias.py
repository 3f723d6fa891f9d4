"""Does the CRM judge the responses or the slots they sit in? (docs/DESIGN.md section 8.3)

A board judges each model's response in slot B against the baseline's in slot A. A pairwise CRM
that learned "B wins" ranks every model near 100% under any criteria, silently. Before judging,
a seeded sample of the board's pairs is judged in both orders: a verdict that names the same slot
in both (A both times, or B both times) followed the slot, not the response. Above
`FOLLOWS_SLOT` of the sample, the board says so on every output, and `both_orders=auto` judges
every pair in both orders (`both_orders` makes one verdict of the two), which cancels a slot
preference at twice the forwards.

Cost: 2 x the sample (64 pairs: 128 sequences, about a quarter of the demo bench's 480), whatever
the votes. A pointwise CRM scores each response alone: it has no slot, and nothing is measured.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

from crm.core.examples import LABEL_A, LABEL_B, swap, verdict

SLOT_SAMPLE = 64
# The demo CRM changes 2-25% of its verdicts when A and B swap on its test sets (Makefile, demo),
# mostly on pairs its criteria barely separate; a CRM past a fifth is reading the slot.
FOLLOWS_SLOT = 0.2


def measure_slot_bias(scorer, examples: Sequence, sample: int = SLOT_SAMPLE, seed: int = 0) -> dict | None:
    """The share of a seeded sample of `examples` (baseline in slot A) whose verdict names the
    same slot in both orders; None for a pointwise CRM or an empty sample."""
    if scorer.kind != "pairwise" or sample <= 0 or not examples:
        return None
    chosen = random.Random(f"crm-slot/{seed}").sample(list(examples), min(sample, len(examples)))
    given = scorer.pair_probabilities(chosen, unfit="nan")
    swapped = scorer.pair_probabilities([swap(e) for e in chosen], unfit="nan")
    counts = {LABEL_A: 0, LABEL_B: 0}
    judged = 0
    for p, q in zip(given.tolist(), swapped.tolist()):
        if any(x != x for x in p + q):  # NaN: the pair does not fit; judge() names it
            continue
        judged += 1
        first, second = verdict(p), verdict(q)
        if first == second and first in counts:
            counts[first] += 1
    follows = counts[LABEL_A] + counts[LABEL_B]
    rate = follows / judged if judged else 0.0
    return {"pairs": judged, "follow_slot": follows, "rate": round(rate, 4),
            "slot": "B" if counts[LABEL_B] >= counts[LABEL_A] else "A",
            "threshold": FOLLOWS_SLOT, "biased": rate > FOLLOWS_SLOT}


def decide_orders(both_orders: bool | str, bias: dict | None) -> bool:
    """Whether a board is judged in both orders: `both_orders` when true or false; "auto", when
    the slot-bias measurement (`measure_slot_bias`) says the verdicts follow the slot."""
    if both_orders == "auto":
        return bool(bias and bias["biased"])
    if not isinstance(both_orders, bool):
        raise ValueError(f"both_orders={both_orders!r}: true, false or auto")
    return both_orders


def both_orders(first, second) -> tuple[list[float], int | None]:
    """A pair's probabilities and verdict from its two orders' (P(A), P(B), P(tie)), both in the
    first order's frame (the second unswapped).

    The probabilities are the normalised geometric mean of the two orders' (their log-
    probabilities averaged): a slot's pull, an offset to the logit of whichever side sits in it,
    enters both sides once and cancels, and a difference between the orders survives where
    probabilities near 0 or 1 would lose it in their arithmetic mean. The verdict is their
    argmax; when the orders name opposite sides, each named the side its slot favoured, and the
    content decides between A and B only: the tie class, which no slot pulls, would otherwise
    take such a pair and throw away the side the content favours.
    """
    if any(x != x for x in [*first, *second]):  # NaN: the pair does not fit; judge() names it
        return [math.nan] * len(first), None
    logs = [(math.log(p) if p > 0 else -math.inf) + (math.log(q) if q > 0 else -math.inf)
            for p, q in zip(first, second)]
    top = max(logs)
    if top == -math.inf:  # no class that both orders give any probability: no verdict
        return [math.nan] * len(logs), None
    weights = [math.exp(x - top) for x in logs]
    probs = [w / sum(weights) for w in weights]
    named = {verdict(first), verdict(second)}
    if named == {LABEL_A, LABEL_B}:
        sides = probs[LABEL_A], probs[LABEL_B]
        return probs, None if sides[0] == sides[1] else LABEL_A if sides[0] > sides[1] else LABEL_B
    return probs, verdict(probs)


def judge_both_orders(scorer, examples: Sequence) -> tuple:
    """(probabilities (n, 3) tensor, verdicts) of `examples` judged in both orders, combined by
    `both_orders`; a pair that does not fit has NaN probabilities and no verdict."""
    import torch  # here: crm-usl and crm-leaderboard read this module before torch loads

    first = scorer.pair_probabilities(examples, unfit="nan").tolist()
    second = scorer.pair_probabilities([swap(e) for e in examples], unfit="nan")[:, [1, 0, 2]]
    combined = [both_orders(p, q) for p, q in zip(first, second.tolist())]
    return (torch.tensor([probs for probs, _ in combined], dtype=torch.float32),
            [v for _, v in combined])
