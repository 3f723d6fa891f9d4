"""Both orders never cost a board its ranking (crm.evaluation.slot_bias.both_orders): a pair the
CRM judges by its slot keeps the side its content favours, where the two orders' averaged
probabilities made it a tie (the tie class ahead of a split A / B) or an exact 0.5 / 0.5 (both
orders near certain). docs/EVALUATION.md section 8 has the measurement on trained CRMs."""
from __future__ import annotations

import math

import pytest
import torch
from test_leaderboard import bench_line, write_bench

from crm.core.examples import LABEL_A, LABEL_B, LABEL_TIE, swap, verdict
from crm.evaluation.leaderboard import leaderboard, select
from crm.evaluation.slot_bias import both_orders

QUALITY = {"m1": 3, "m2": 2, "m3": 1, "m4": 0, "base": 1.5}  # under "x"; "y" reverses it


@pytest.mark.parametrize("first, second, expected", [
    # the orders name opposite sides (each its slot's), the tie class ahead in their mean: the
    # content's side (B's log-probabilities are the higher), not the tie
    ([0.08, 0.55, 0.37], [0.45, 0.12, 0.43], LABEL_B),
    # both orders near certain of their slot: the mean is 0.5 / 0.5 to the last bit; the less
    # certain side in each order still tells which side the content favours
    ([1e-9, 1.0, 0.0], [1.0, 3e-9, 0.0], LABEL_B),
    ([1e-9, 1.0, 0.0], [1.0, 1e-9, 0.0], None),  # nothing between them: a score tie
    ([0.1, 0.3, 0.6], [0.2, 0.2, 0.6], LABEL_TIE),  # the tie in both orders stays a tie
    ([0.7, 0.1, 0.2], [0.6, 0.3, 0.1], LABEL_A),  # orders that agree: their side
])
def test_a_pair_judged_in_both_orders_keeps_its_content(first, second, expected):
    probs, v = both_orders(first, second)
    assert v == expected and math.isclose(sum(probs), 1.0)
    # what averaging the probabilities gave (the scorer's float32): the content lost
    mean = ((torch.tensor(first) + torch.tensor(second)) / 2).tolist()
    if expected == LABEL_B:
        assert verdict(mean) in (LABEL_TIE, None)


class SlotAndTie:
    """A pairwise CRM with a tie class that reads the slot first: slot B's logit 2 above the
    side's content (its quality under the criteria, a small term) and the tie's 1.8, so that it
    names slot B in each order and the tie class holds the most of the two orders' mean."""

    kind = "pairwise"

    def __init__(self):
        self.counts = {}

    def pair_probabilities(self, examples, unfit="raise", both_orders=False):
        rows = []
        for e in examples:
            sign = 1 if e.criteria == ("x",) else -1
            a, b = (sign * QUALITY[c[-1].content] * 0.05 for c in (e.conv_a, e.conv_b))
            rows.append(torch.tensor([a, b + 2.0, 1.8]).softmax(-1).tolist())
        probs = torch.tensor(rows)
        if both_orders:  # as CRMScorer averages them
            probs = (probs + self.pair_probabilities([swap(e) for e in examples])[:, [1, 0, 2]]) / 2
        return probs


def test_a_slot_reading_crm_with_a_tie_class_keeps_its_ranking_in_both_orders(tmp_path):
    """Under contradictory criteria the boards judged in both orders reverse each other (tau -1)
    where the averaged probabilities made every pair a tie (no ranking at all); in one order
    every model wins everything."""
    lines = [bench_line(f"q{i}", "t", {m: m for m in QUALITY}) for i in range(6)]
    selection = select(write_bench(tmp_path / "bench.jsonl", lines), "base")
    one = leaderboard(SlotAndTie(), selection, ["x"], contrast=["y"], both_orders=False)
    assert {r["overall"]["win_rate"] for b in one["boards"] for r in b["rows"]} == {1.0}
    both = leaderboard(SlotAndTie(), selection, ["x"], contrast=["y"], both_orders=True)
    assert both["kendall_tau"]["tau"] == -1.0
    assert [r["model"] for r in both["boards"][0]["rows"]] == ["m1", "m2", "m3", "m4"]
