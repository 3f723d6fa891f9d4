"""CRMScorer (crm.inference.scorer): the plain path, prefix reuse, both orders, loading."""
from __future__ import annotations

import pytest
import torch
from scorers import tiny_scorer

from crm.models.export import export_crm
from crm.core.records import Message
from crm.inference.scorer import CRMScorer, Preference
from crm.core.examples import PairExample, swap


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def answer(text: str):
    return (Message("assistant", text),)


CRITERIA = ("concise answer", "is friendly")


def leaderboard_examples(n_queries: int = 3, n_candidates: int = 5) -> list[PairExample]:
    """Each query's baseline (slot A) against candidates of different lengths (slot B)."""
    out = []
    for q in range(n_queries):
        query = f"question {q} " + "the a of " * q
        base = answer("alpha reply " * (3 + 2 * q))
        for c in range(n_candidates):
            out.append(PairExample(f"{q}/{c}", CRITERIA[: 1 + q % 2], query, base,
                                   answer("beta reply " * (1 + 3 * c) + "answer"), 0))
    return out


def both_paths(scorer: CRMScorer, examples) -> tuple[torch.Tensor, torch.Tensor]:
    scorer.prefix_reuse = False
    plain = scorer.pair_probabilities(examples)
    scorer.prefix_reuse = True
    scorer.counts.clear()
    reused = scorer.pair_probabilities(examples)
    return plain, reused


@pytest.mark.parametrize("batch_size", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("num_labels", [2, 3])
def test_prefix_reuse_equals_the_plain_path_pairwise(batch_size, num_labels):
    scorer = tiny_scorer(num_labels=num_labels, batch_size=batch_size)
    examples = leaderboard_examples()
    plain, reused = both_paths(scorer, examples)
    assert scorer.counts["prefix_sequences"] == len(examples)  # every row went the prefix way
    assert scorer.counts["computed_tokens"] < scorer.counts["prompt_tokens"]
    torch.testing.assert_close(reused, plain, atol=1e-4, rtol=0)
    # ... and neither depends on the batch size: the same as scoring each pair alone.
    alone = tiny_scorer(num_labels=num_labels, batch_size=1, prefix_reuse=False)
    for i in (0, 7, len(examples) - 1):
        torch.testing.assert_close(alone.pair_probabilities([examples[i]])[0], plain[i],
                                   atol=1e-4, rtol=0)


def test_prefix_reuse_in_the_swapped_order_shares_criteria_and_query():
    scorer = tiny_scorer(batch_size=4)
    # candidates in slot A now: only criteria + query are shared, so make them long enough to
    # save a third of the tokens
    examples = [PairExample(e.key, e.criteria * 8, e.query + " the a of" * 40, e.conv_a, e.conv_b, 0)
                for e in leaderboard_examples()]
    examples = [swap(e) for e in examples]
    plain, reused = both_paths(scorer, examples)
    assert scorer.counts["prefix_sequences"] == len(examples)
    torch.testing.assert_close(reused, plain, atol=1e-4, rtol=0)


def test_groups_that_save_little_take_the_plain_path():
    scorer = tiny_scorer("pointwise")
    # a test pair: two long responses sharing a short criteria + query
    items = [(CRITERIA[:1], "q", answer("alpha reply " * 30)), (CRITERIA[:1], "q", answer("beta " * 30))]
    scorer.score_many(items)
    assert scorer.counts["prefix_declined"] == 2 and scorer.counts["prefix_sequences"] == 0


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_prefix_reuse_equals_the_plain_path_pointwise(batch_size):
    scorer = tiny_scorer("pointwise", batch_size=batch_size)
    items = [(CRITERIA, f"question {q}", answer("beta reply " * (1 + 2 * r))) for q in range(3)
             for r in range(4)]
    scorer.prefix_reuse = False
    plain = scorer.score_many(items)
    scorer.prefix_reuse = True
    reused = scorer.score_many(items)
    assert scorer.counts["prefix_sequences"] == len(items)
    torch.testing.assert_close(reused, plain, atol=1e-4, rtol=0)


def test_pointwise_pairs_score_each_distinct_response_once():
    scorer = tiny_scorer("pointwise")
    examples = leaderboard_examples(n_queries=2, n_candidates=4)  # 8 pairs, 2 baselines
    probs = scorer.pair_probabilities(examples)
    assert scorer.counts["sequences"] == 2 + 8
    rewards = scorer.score_many([(e.criteria, e.query, e.conv_b) for e in examples[:1]]
                                + [(e.criteria, e.query, e.conv_a) for e in examples[:1]])
    assert probs[0, 0].item() == pytest.approx(torch.sigmoid(rewards[1] - rewards[0]).item(),
                                               abs=1e-5)
    torch.testing.assert_close(probs[:, 0] + probs[:, 1], torch.ones(8))


def test_rows_whose_tokens_differ_at_the_split_take_the_plain_path():
    # A tokenizer that learned merges of runs of newlines: a response starting with newlines then
    # merges with the newline that ends the slot header, unlike its prefix and rest alone.
    from helpers import CORPUS

    from crm.models.tokenizer import train_bpe_tokenizer
    tok = train_bpe_tokenizer(CORPUS * 4 + ["x\n\n\n  y"] * 50, vocab_size=300)
    scorer = tiny_scorer(batch_size=4, tokenizer=tok)
    examples = leaderboard_examples(n_queries=1, n_candidates=4)
    odd = PairExample("odd", examples[0].criteria, examples[0].query, examples[0].conv_a,
                      answer("\n\n  beta"), 0)
    plain, reused = both_paths(scorer, examples + [odd])
    assert scorer.counts["split_mismatch"] == 1 and scorer.counts["prefix_sequences"] == 4
    torch.testing.assert_close(reused, plain, atol=1e-4, rtol=0)


def test_prompts_shortened_by_the_length_policy():
    # The policy shortens the longest messages first: a long candidate alone is cut and still
    # starts with the baseline's prefix; a long candidate next to a long baseline cuts the
    # baseline too, and that row no longer shares the prefix.
    scorer = tiny_scorer(max_tokens=300, batch_size=2)
    base = answer("alpha reply " * 15)
    examples = [PairExample(str(i), CRITERIA, "question", base, answer(text), 0) for i, text in
                enumerate(["beta reply", "the answer", "beta reply " * 150])]
    fits = scorer.encoder.fit_pairwise([(e.criteria, e.query, e.conv_a, e.conv_b) for e in examples])
    assert [f.shortened for f in fits] == [False, False, True]
    plain, reused = both_paths(scorer, examples)
    assert scorer.counts["split_mismatch"] == 1 and scorer.counts["prefix_sequences"] == 2
    torch.testing.assert_close(reused, plain, atol=1e-4, rtol=0)

    examples = leaderboard_examples(n_queries=1, n_candidates=3)  # a short baseline
    examples.append(PairExample("long", examples[0].criteria, examples[0].query,
                                examples[0].conv_a, answer("beta reply " * 200), 0))
    plain, reused = both_paths(scorer, examples)
    assert scorer.counts["split_mismatch"] == 0 and scorer.counts["prefix_sequences"] == 4
    torch.testing.assert_close(reused, plain, atol=1e-4, rtol=0)


def test_a_pair_that_cannot_fit_raises_or_is_nan():
    scorer = tiny_scorer(max_tokens=40)
    examples = leaderboard_examples(n_queries=1, n_candidates=2)
    with pytest.raises(ValueError, match="2 pairs cannot fit in 40 tokens"):
        scorer.pair_probabilities(examples)
    assert torch.isnan(scorer.pair_probabilities(examples, unfit="nan")).all()


def test_compare_both_orders_and_the_tie_probability():
    scorer = tiny_scorer(num_labels=3)
    a, b = "alpha reply answer", "beta reply"
    p = scorer.compare(CRITERIA, "question", a, b)
    assert isinstance(p, Preference) and 0.0 < p < 1.0 and 0.0 < p.tie < 1.0
    rows = scorer.compare_many([(CRITERIA, "question", a, b), (CRITERIA, "question", b, a)])
    assert float(p) == pytest.approx(rows[0, 0].item()) and p.tie == pytest.approx(rows[0, 2].item())
    debiased = scorer.compare(CRITERIA, "question", a, b, both_orders=True)
    assert float(debiased) == pytest.approx((rows[0, 0] + rows[1, 1]).item() / 2, abs=1e-6)
    assert debiased.tie == pytest.approx((rows[0, 2] + rows[1, 2]).item() / 2, abs=1e-6)
    two_way = tiny_scorer().compare(CRITERIA, "question", a, b)
    assert two_way.tie == 0.0
    # messages work as responses too, multi-turn included
    convo = [{"role": "assistant", "content": a}, {"role": "user", "content": "more?"},
             {"role": "assistant", "content": "yes"}]
    assert 0.0 < scorer.compare(CRITERIA, "question", convo, b) < 1.0


def test_score_needs_a_pointwise_model():
    with pytest.raises(ValueError, match="needs a pointwise CRM"):
        tiny_scorer().score(CRITERIA, "question", "alpha")
    assert isinstance(tiny_scorer("pointwise").score(CRITERIA, "question", "alpha"), float)


def test_load_an_export_and_a_training_checkpoint(tmp_path):
    scorer = tiny_scorer()
    export = tmp_path / "run" / "export"
    export_crm(scorer.model, scorer.tokenizer, export, kind="pairwise", template=scorer.template,
               max_tokens=1000)
    loaded = CRMScorer.load(export, device=torch.device("cpu"), dtype=torch.float32)
    examples = leaderboard_examples(n_queries=1, n_candidates=2)
    torch.testing.assert_close(loaded.pair_probabilities(examples),
                               scorer.pair_probabilities(examples))
    assert loaded.device.type == "cpu" and next(loaded.model.parameters()).dtype == torch.float32

    # a crm-train checkpoint: the HF model's weights under "crm.model.", and its card (tokenizer,
    # config, template), so that it scores with nothing beside it
    from crm.models.checkpoint import describe

    other = tiny_scorer(seed=1)
    ckpt = tmp_path / "elsewhere" / "last.ckpt"
    ckpt.parent.mkdir()
    torch.save({"state_dict": {f"crm.model.{k}": v for k, v in other.model.state_dict().items()},
                "global_step": 3, "crm_card": describe(other.model, other.tokenizer, kind="pairwise",
                                                       template=other.template, max_tokens=1000)},
               ckpt)
    from_ckpt = CRMScorer.load(ckpt, device=torch.device("cpu"), dtype=torch.float32)
    torch.testing.assert_close(from_ckpt.pair_probabilities(examples),
                               other.pair_probabilities(examples))
    with pytest.raises(FileNotFoundError, match="neither an export directory"):
        CRMScorer.load(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no crm_card in the checkpoint"):
        torch.save({"state_dict": {}, "global_step": 0}, ckpt)
        CRMScorer.load(ckpt)


def test_a_davidson_crm_gives_its_tie_probability_from_an_export_and_a_checkpoint(tmp_path):
    import math

    from crm.models.checkpoint import describe
    from crm.models.heads import davidson_logits

    ties = {"model": "davidson", "log_nu": math.log(3.0)}
    scorer = tiny_scorer("pointwise", ties=ties)
    examples = leaderboard_examples(n_queries=1, n_candidates=3)
    probs = scorer.pair_probabilities(examples)
    rewards = scorer.score_many([(e.criteria, e.query, c) for e in examples for c in (e.conv_a, e.conv_b)])
    expected = davidson_logits(rewards[0::2] - rewards[1::2], torch.tensor([math.log(3.0)])).softmax(-1)
    torch.testing.assert_close(probs, expected)
    assert (probs[:, 2] > 0.4).all()  # near-equal rewards of a random model: ties, under nu = 3
    export = tmp_path / "export"
    export_crm(scorer.model, scorer.tokenizer, export, kind="pointwise", template=scorer.template,
               max_tokens=1000, extra={"ties": ties})
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {**{f"crm.model.{k}": v for k, v in scorer.model.state_dict().items()},
                               "crm.tie_log_nu": torch.tensor([math.log(3.0)])},
                "global_step": 3, "crm_card": describe(scorer.model, scorer.tokenizer,
                                                       kind="pointwise", template=scorer.template,
                                                       max_tokens=1000)}, ckpt)
    for path in (export, ckpt):
        loaded = CRMScorer.load(path, device=torch.device("cpu"), dtype=torch.float32)
        torch.testing.assert_close(loaded.pair_probabilities(examples), probs)
