"""crm-train's end check for shortcuts (crm.evaluation.criteria_check): judges whose behaviour is
known by construction, so each figure has one right value."""
from __future__ import annotations

import torch
from helpers import train_dict

from crm.core.records import parse_train
from crm.evaluation.criteria_check import contradictory_pairs, shortcut_check

RECORDS = [parse_train(train_dict(f"k{i}", ("model_a", "model_b", "tie")[i % 3])) for i in range(9)]


class Judge:
    """A pairwise judge: `rule(example)` -> the slot it prefers (0: A, 1: B)."""

    kind = "pairwise"

    def __init__(self, rule):
        self.rule = rule
        self.counts = {}

    def pair_probabilities(self, examples, unfit="raise", both_orders=False):
        return torch.tensor([[0.9, 0.1, 0.0] if self.rule(e) == 0 else [0.1, 0.9, 0.0]
                             for e in examples])


def reads_criteria(example) -> int:
    """train_dict's criteria name their side ("k0 a0": A's) and its answers their model ("alpha"
    is model_a's): the slot holding the answer the criteria favour, wherever it sits."""
    wanted = "alpha" if example.criteria[0].split()[1].startswith("a") else "beta"
    return 0 if example.conv_a[-1].content.startswith(wanted) else 1


def test_ties_are_left_out_and_a_two_sided_record_gives_two_contradictory_pairs():
    pairs = contradictory_pairs(RECORDS)
    assert len(pairs) == 2 * 6  # 3 of the 9 are ties
    first, second = pairs[:2]
    assert (first.preference, first.criteria) == ("model_a", ("k0 a0", "k0 a1"))
    assert (second.preference, second.criteria) == ("model_b", ("k0 b0", "k0 b1"))
    assert len(contradictory_pairs(RECORDS, most=2)) == 4


def test_a_judge_that_reads_the_criteria_passes_and_shortcuts_are_named():
    good = shortcut_check(Judge(reads_criteria), RECORDS)
    assert (good["accuracy_mean"], good["flip_rate"], good["same_verdict_under_both_criteria"]) == \
        (1.0, 0.0, 0.0)
    assert good["warnings"] == [] and good["records"] == 6
    slot = shortcut_check(Judge(lambda e: 1), RECORDS)  # "B wins", whatever B holds
    assert slot["flip_rate"] == 1.0 and slot["same_verdict_under_both_criteria"] == 1.0
    assert [w.split(":")[0] for w in slot["warnings"]] == ["criteria-blind", "slot-following"]
    assert "loss=ranking" in slot["warnings"][0] and "both_orders=true" in slot["warnings"][1]
    # The answer it likes best, whatever the criteria: blind, but not to the slot.
    blind = shortcut_check(Judge(lambda e: 0 if e.conv_a[-1].content.startswith("alpha") else 1),
                           RECORDS)
    assert blind["accuracy_mean"] == 0.5 and blind["flip_rate"] == 0.0
    assert [w.split(":")[0] for w in blind["warnings"]] == ["criteria-blind"]
    assert shortcut_check(Judge(lambda e: 0), RECORDS[2:3]) is None  # a tie alone: nothing to judge
