"""What the real benchmark files showed (docs/EVALUATION.md): prompts the fit check passes are ones
the encoder can encode, and one it cannot is counted, never an abort; RM-Bench's per-domain files;
RewardBench 2's Ties version named and an unpaired Ties subset not called missing."""
from __future__ import annotations

import json
import math

import pytest
from scorers import tiny_scorer

from crm.core.records import Message
from crm.evaluation.benchmarks import (BenchmarkConfig, BenchmarkError, Item, aggregate,
                                       load_benchmark, score_items)
from crm.inference.reward import CRMReward

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
LONG = "an answer that goes on " * 60


@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_every_prompt_the_fit_check_passes_the_encoder_encodes(kind):
    """Criteria and query of growing length under a 300-token limit with long answers: where the
    check says the answers have room, the length policy can shorten them into it."""
    scorer = tiny_scorer(kind, max_tokens=300)
    reward, encoder = CRMReward(scorer), scorer.encoder
    answer, other = (Message("assistant", LONG),), (Message("assistant", LONG + " more"),)
    passed = 0
    for words in range(30):  # about 9 tokens a word for the tiny tokenizer
        query = "what is the question " + "and more " * words
        if not reward.fits([(("short answers",), query)])[0]:
            continue
        passed += 1
        if kind == "pairwise":
            ids = encoder.pairwise_many([(("short answers",), query, answer, other)])[0]
        else:
            ids = encoder.pointwise_many([(("short answers",), query, answer)])[0]
        assert ids is not None, f"{words} words: passed the fit check, dropped by the encoder"
    assert 0 < passed < 30  # the range crosses the limit


def test_a_prompt_the_encoder_drops_after_the_check_is_counted_not_an_abort(monkeypatch):
    scorer = tiny_scorer("pairwise", max_tokens=160, batch_size=8)
    rows = [Item("a", "x", "question", ("alpha reply", "beta reply"), ("short",), 1),
            Item("b", "x", "question " + "word " * 100, (LONG, LONG + " more"), ("short",), 1)]
    # a length check that passes everything: what a disagreement with the encoder looked like
    monkeypatch.setattr(CRMReward, "_overflow", lambda self, pairs: [None] * len(pairs))
    scores, counts = score_items(scorer, rows)
    assert counts["unscorable"] == 1 and all(math.isnan(s) for s in scores[1])
    assert not any(math.isnan(s) for s in scores[0])


def rmbench_row(row_id: int) -> dict:
    """A row of RM-Bench's own per-domain file: an int id, no domain, keys crm does not read."""
    return {"id": row_id, "prompt": f"write code {row_id}", "chosen": ["a1", "a2", "a3"],
            "rejected": ["b1", "b2", "b3"], "subset": "code", "error": [], "language": "python",
            "task_id": f"t{row_id}"}


def rmbench(path) -> BenchmarkConfig:
    return BenchmarkConfig("rmbench", str(path), {"default": ["Correct"]})


def test_rmbench_domain_files_take_the_domain_from_their_name(tmp_path):
    code = tmp_path / "code_filtered.json"
    code.write_text(json.dumps([rmbench_row(123), rmbench_row(126)]))
    benchmark = load_benchmark(rmbench(code))
    assert [(i.id, i.subset) for i in benchmark.items] == [("123", "code"), ("126", "code")]
    refuse = tmp_path / "safety-refuse_filtered.json"
    refuse.write_text(json.dumps([rmbench_row(1)]))
    assert load_benchmark(rmbench(refuse)).items[0].subset == "safety-refuse"
    unnamed = tmp_path / "rows.json"
    unnamed.write_text(json.dumps([rmbench_row(1)]))
    with pytest.raises(BenchmarkError, match=r"rows.json:row 1: domain: missing, and the file's "
                                             r"name 'rows.json' names no domain"):
        load_benchmark(rmbench(unnamed))


def test_an_unpaired_ties_subset_is_present_and_unscored_not_missing():
    rows = [Item("0", "Math", "q", ("a", "b"), (), 1), Item("ref:1", "Ties", "q", ("a", "b"), (), 1)]
    metrics = aggregate("rewardbench2", rows, [[1.0, 0.0], [1.0, 0.0]])
    assert "Ties" not in metrics["missing"] and metrics["unscored"] == ["Ties"]
    assert metrics["score"] == 1.0  # Math alone
    assert "#244" in metrics["ties_formula"] and "0.1.4" in metrics["ties_formula"]
