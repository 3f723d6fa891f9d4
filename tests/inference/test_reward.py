"""crm.CRMReward (crm/inference/reward.py): TRL's reward-function contract, the three strategies,
their exact model-forward counts, the verdict cache, grouping by value, and the one-line errors.
Its export from `crm` is checked with the others (tests/test_api.py)."""
from __future__ import annotations

import math
import re

import pytest
from scorers import export_tiny, tiny_scorer

from crm.inference import reward as reward_module
from crm.inference.reward import CRMReward, CRMRewardError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CRITERIA = ["concise answer", "is friendly"]
Q1, Q2 = "question one", "question two"


def counted(kind: str = "pairwise", num_labels: int = 2, seed: int = 0):
    """A tiny CRM whose model counts the rows it runs (prefix reuse off: one row per sequence)."""
    scorer = tiny_scorer(kind, num_labels=num_labels, seed=seed, prefix_reuse=False)
    rows = []
    scorer.model.model.register_forward_hook(lambda module, args, kwargs, out: rows.append(
        kwargs["input_ids"].shape[0]), with_kwargs=True)
    return scorer, rows


def call(reward, prompts, completions, criteria=CRITERIA, **columns):
    return reward(prompts=prompts, completions=completions, completion_ids=None,
                  criteria=[criteria] * len(completions), **columns)


def test_symmetrised_win_probabilities_sum_to_one():
    for num_labels in (2, 3):  # with a tie class, a tie counts half to each side
        reward = CRMReward(tiny_scorer(num_labels=num_labels), "reference")
        a, b = "alpha reply", "beta reply the a of"
        p_ab = call(reward, [Q1], [a], reference=[b])[0]
        p_ba = call(reward, [Q1], [b], reference=[a])[0]
        assert p_ab != pytest.approx(0.5, abs=1e-6)
        assert p_ab + p_ba == pytest.approx(1.0, abs=1e-6)
        # round robin of two: the two rewards are P(a, b) and P(b, a)
        both = call(CRMReward(reward.scorer, "round_robin"), [Q1, Q1], [a, b])
        assert both == pytest.approx([p_ab, p_ba], abs=1e-6)


@pytest.mark.parametrize("kind,strategy,completions,forwards", [
    # pairwise CRM, round robin: each ordered pair of distinct completions once, G(G-1)
    ("pairwise", "round_robin", ["a", "b", "c", "d"], 12),
    ("pairwise", "round_robin", ["a", "b", "a", "c"], 6),  # 3 distinct: 3 * 2
    ("pairwise", "round_robin", ["a", "a", "a", "a"], 0),  # identical: ties, no forward
    # pairwise CRM against the reference: both orders per distinct completion
    ("pairwise", "reference", ["a", "b", "c", "d"], 8),
    ("pairwise", "reference", ["a", "b", "a", "ref"], 4),  # the reference itself ties at 0.5
    # pointwise CRM: each distinct completion once (+ the reference once)
    ("pointwise", "pointwise", ["a", "b", "c", "a"], 3),
    ("pointwise", "reference", ["a", "b", "c", "d"], 5),
    ("pointwise", "round_robin", ["a", "b", "c", "c"], 3),
])
def test_model_forwards_per_group_are_what_the_strategy_says(kind, strategy, completions, forwards):
    scorer, rows = counted(kind, num_labels=2 if kind == "pairwise" else 1)
    reward = CRMReward(scorer, strategy)
    columns = {"reference": ["ref"] * len(completions)} if strategy == "reference" else {}
    first = call(reward, [Q1] * len(completions), completions, **columns)
    assert sum(rows) == forwards == reward.counts["forwards"]
    again = call(reward, [Q1] * len(completions), completions, **columns)
    assert sum(rows) == forwards and reward.counts["forwards"] == forwards  # cache hit: 0 more
    assert again == first
    if kind == "pairwise" and strategy == "round_robin" and len(set(completions)) == 1:
        assert first == [0.5] * len(completions)


def test_groups_are_criteria_and_prompt_by_value_never_by_position():
    reward = CRMReward(tiny_scorer(), "round_robin")
    grouped = call(reward, [Q1, Q1, Q1, Q2, Q2, Q2], ["a", "b", "c", "d", "e", "f"])
    # the same completions interleaved (as a batch holding both prompts in any order)
    order = [0, 3, 1, 4, 2, 5]
    mixed = call(reward, [[Q1, Q1, Q1, Q2, Q2, Q2][i] for i in order],
                 [["a", "b", "c", "d", "e", "f"][i] for i in order])
    assert mixed == pytest.approx([grouped[i] for i in order], abs=1e-6)
    # the same prompt under other criteria is another group
    separate = reward(prompts=[Q1] * 4, completions=["a", "b", "c", "d"],
                      criteria=[CRITERIA, CRITERIA, ["other"], ["other"]])
    assert separate[:2] == pytest.approx(call(reward, [Q1, Q1], ["a", "b"]), abs=1e-6)


def test_a_group_split_across_processes_is_judged_whole(monkeypatch):
    """TRL may give two processes parts of one group: the reward gathers them (as
    torch.distributed.all_gather_object would) and each process scores its rows against all."""
    prompts, completions = [Q1, Q1, Q2, Q1, Q2, Q2], ["a", "b", "x", "c", "y", "z"]
    whole = call(CRMReward(tiny_scorer(), "round_robin"), prompts, completions)
    reward = CRMReward(tiny_scorer(), "round_robin")
    parts = [slice(0, 3), slice(3, 6)]
    rows = [reward.rows(prompts[s], completions[s], {"criteria": [CRITERIA] * 3}) for s in parts]
    for rank, s in enumerate(parts):
        monkeypatch.setattr(reward_module, "gather_rows",
                            lambda own, rank=rank: (rows[0] + rows[1], 3 * rank))
        assert call(reward, prompts[s], completions[s]) == pytest.approx(whole[s], abs=1e-6)


def test_different_criteria_give_different_rewards_for_the_same_completions():
    for kind, strategy in (("pairwise", "round_robin"), ("pointwise", "pointwise")):
        reward = CRMReward(tiny_scorer(kind, num_labels=2 if kind == "pairwise" else 1), strategy)
        a = call(reward, [Q1] * 3, ["a", "b the a of", "c"], criteria=["concise answer"])
        b = call(reward, [Q1] * 3, ["a", "b the a of", "c"], criteria=["friendly detailed"])
        assert max(abs(x - y) for x, y in zip(a, b)) > 1e-6


def test_chat_prompts_and_completions_read_as_their_text():
    reward = CRMReward(tiny_scorer(), "round_robin")
    text = call(reward, [Q1, Q1], ["alpha reply", "beta reply"])
    chat = call(reward, [[{"role": "system", "content": "You are a bot."},
                          {"role": "user", "content": Q1}]] * 2,
                [[{"role": "assistant", "content": "alpha reply"}],
                 [{"role": "assistant", "content": [{"type": "text", "text": "beta reply"}]}]])
    assert chat == pytest.approx(text, abs=1e-6)  # the policy's system prompt is not the user's
    # one string is one criterion
    assert reward(prompts=[Q1, Q1], completions=["alpha reply", "beta reply"],
                  criteria=["concise answer"] * 2) == call(reward, [Q1, Q1], ["alpha reply", "beta reply"],
                                                           criteria=["concise answer"])


def test_log_odds_are_the_logit_of_the_probabilities():
    scorer = tiny_scorer()
    p = call(CRMReward(scorer, "round_robin"), [Q1, Q1], ["a", "b"])
    z = call(CRMReward(scorer, "round_robin", log_odds=True), [Q1, Q1], ["a", "b"])
    assert z == pytest.approx([math.log(x / (1 - x)) for x in p], abs=1e-6)
    point = tiny_scorer("pointwise", num_labels=1)
    r = call(CRMReward(point, "pointwise"), [Q1, Q1], ["a", "b"])
    assert call(CRMReward(point, "reference", tau=2.0), [Q1], ["a"], reference=["b"])[0] == \
        pytest.approx(1 / (1 + math.exp(-(r[0] - r[1]) / 2.0)), abs=1e-6)


def test_trl_keyword_arguments_are_accepted_and_forwards_logged():
    logged = {}
    reward = CRMReward(tiny_scorer(), "round_robin")
    out = reward(prompts=[Q1, Q1], completions=["a", "b"], completion_ids=[[1], [2]],
                 criteria=[CRITERIA] * 2, trainer_state=object(), log_extra=lambda c, v: None,
                 log_metric=logged.__setitem__)
    assert len(out) == 2 and logged == {"crm_round_robin/forwards": 2.0}
    assert reward.__name__ == "crm_round_robin"  # TRL's metric names: rewards/<name>/mean


@pytest.mark.parametrize("columns,message", [
    ({}, "no 'criteria' column: the dataset needs one"),
    ({"criteria": [[], []]}, "row 0: 'criteria' is empty or holds an empty or non-string criterion"),
    ({"criteria": [["ok"], [""]]}, "row 1: 'criteria' is empty"),
    ({"criteria": ["ok", None]}, "row 1: 'criteria' is NoneType; expected a list of strings"),
    ({"criteria": [["ok"]]}, "'criteria' has 1 values for 2 completions"),
])
def test_missing_or_empty_criteria_are_one_line_errors(columns, message):
    reward = CRMReward(tiny_scorer(), "round_robin")
    with pytest.raises(CRMRewardError, match=re.escape(message)) as err:
        reward(prompts=[Q1, Q1], completions=["a", "b"], **columns)
    assert "\n" not in str(err.value)


def test_criteria_too_long_for_the_model_are_refused():
    reward = CRMReward(tiny_scorer(max_tokens=200), "round_robin")
    # each answer needs 16 tokens and the 7-token ellipsis the length policy marks a cut with
    with pytest.raises(CRMRewardError, match=r"row 0: the criteria and query take \d+ tokens; the "
                                             r"CRM reads at most 200 with 46 left for the answers"):
        call(reward, [Q1, Q1], ["a", "b"], criteria=["the a of " * 100])


def test_not_a_crm_checkpoint_is_one_line(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # a HF model dir, not a CRM
    (tmp_path / "weights.ckpt").write_bytes(b"not a checkpoint")
    for path, reason in ((tmp_path / "missing", "no such export directory or checkpoint"),
                         (tmp_path / "model", "not a CRM checkpoint"),
                         (tmp_path / "weights.ckpt", "not a CRM checkpoint")):
        with pytest.raises(CRMRewardError, match=reason) as err:
            CRMReward(path)
        assert "\n" not in str(err.value)


def test_loads_an_export_and_picks_the_strategy_of_its_kind(tmp_path):
    reward = CRMReward(export_tiny(tmp_path / "pairwise"))
    assert reward.strategy == "round_robin" and reward.scorer.kind == "pairwise"
    point = CRMReward(export_tiny(tmp_path / "pointwise", kind="pointwise", num_labels=1))
    assert point.strategy == "pointwise"


@pytest.mark.parametrize("kind,kwargs,message", [
    ("pairwise", {"strategy": "pointwise"}, "needs a pointwise CRM"),
    ("pairwise", {"strategy": "best_of"}, "one of pointwise, reference, round_robin"),
    ("pairwise", {"tau": 2.0}, "tau=2.0: the positive temperature of a pointwise CRM"),
    ("pointwise", {"strategy": "pointwise", "log_odds": True}, "already unbounded"),
])
def test_settings_that_cannot_work_are_refused(kind, kwargs, message):
    with pytest.raises(CRMRewardError, match=message):
        CRMReward(tiny_scorer(kind, num_labels=2 if kind == "pairwise" else 1), **kwargs)


def test_reference_strategy_needs_the_reference_column():
    reward = CRMReward(tiny_scorer(), "reference")
    with pytest.raises(CRMRewardError, match="needs a 'reference' column"):
        call(reward, [Q1], ["a"])
    with pytest.raises(CRMRewardError, match="row 0: no reference answer"):
        call(reward, [Q1], ["a"], reference=[None])
