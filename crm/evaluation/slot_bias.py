"""Does the CRM judge the responses or the slots they sit in? (docs/DESIGN.md section 8.3)

A board judges each model's response in slot B against the baseline's in slot A. A pairwise CRM
that learned "B wins" ranks every model near 100% under any criteria, silently. Before judging,
a seeded sample of the board's pairs is judged in both orders: a verdict that names the same slot
in both (A both times, or B both times) followed the slot, not the response. Above
`FOLLOWS_SLOT` of the sample, the board says so on every output, and `both_orders=auto` judges
every pair in both orders (averaged), which cancels a slot preference at twice the forwards.

Cost: 2 x the sample (64 pairs: 128 sequences, about a quarter of the demo bench's 480), whatever
the votes. A pointwise CRM scores each response alone: it has no slot, and nothing is measured.
"""
from __future__ import annotations

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
