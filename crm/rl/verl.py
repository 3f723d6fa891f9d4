"""A CRM as the batch reward function of verl before its reward loop (verl older than 0.7, not
tested here; verl 0.7-0.9 never calls it: crm/rl/verl_manager.py is their adapter):

    reward_model.reward_manager=batch
    custom_reward_function.path=$(python -c "import crm.rl.verl as m; print(m.__file__)")
    custom_reward_function.name=compute_score
    +custom_reward_function.reward_kwargs.checkpoint=/path/to/crm/export

Checked against verl's own source (github.com/volcengine/verl): verl/workers/reward_manager/batch.py
`BatchRewardManager.verify` calls `compute_score(data_sources=..., solution_strs=...,
ground_truths=..., extra_infos=..., **reward_kwargs)` once for the whole batch, where
`solution_strs` are the responses decoded without special tokens, `ground_truths` each sample's
`reward_model.ground_truth` and `extra_infos` its `extra_info`; it takes a list with one float (or
a dict with "score") per sample. verl/trainer/ppo/reward.py `get_custom_reward_fn` loads this file
by path and merges `custom_reward_function.reward_kwargs` into the call.

The criteria are the ground truth (crm/rl/labels.py); the user's query is the label's `query`, else
`extra_info["question"]` (where verl's data preprocessing examples keep the raw question). The
batch holds every rollout of a prompt, so `round_robin` (the default for a pairwise CRM) sees
whole groups. The reward is loaded once per process and setting, and keeps its verdict cache
across steps.
"""
from __future__ import annotations

import functools

from crm.inference.reward import CRMReward, CRMRewardError
from crm.rl.labels import parse_label


@functools.lru_cache(maxsize=4)
def _reward(checkpoint: str, strategy: str | None, tau: float, log_odds: bool,
            batch_size: int) -> CRMReward:
    return CRMReward(checkpoint, strategy, tau=tau, log_odds=log_odds, batch_size=batch_size)


def compute_score(data_sources=None, solution_strs=None, ground_truths=None, extra_infos=None, *,
                  checkpoint: str | None = None, strategy: str | None = None, tau: float = 1.0,
                  log_odds: bool = False, batch_size: int = 32, **kwargs) -> list[float]:
    """One reward per response; `checkpoint` and the rest come from reward_kwargs."""
    if "solution_str" in kwargs:  # verl 0.7+'s reward loop: one response per call
        raise CRMRewardError("verl's reward loop calls compute_score one response at a time, so "
                             "a CRM cannot compare a prompt's rollouts or batch them: use its reward "
                             "manager, reward.reward_manager.module.path=pkg://crm.rl.verl_manager "
                             "(docs/RL.md)")
    if checkpoint is None:
        raise CRMRewardError("no CRM: set custom_reward_function.reward_kwargs.checkpoint=PATH")
    reward = _reward(str(checkpoint), strategy, float(tau), bool(log_odds), int(batch_size))
    queries, criteria, references = [], [], []
    for i, (truth, extra) in enumerate(zip(ground_truths, extra_infos)):
        label = parse_label(truth, i)
        query = label.query or (extra or {}).get("question")
        if not isinstance(query, str) or not query:
            raise CRMRewardError(f"row {i}: no query: put it in the ground truth "
                                 "({\"criteria\": [...], \"query\": \"...\"}) or in "
                                 "extra_info[\"question\"]")
        queries.append(query)
        criteria.append(label.criteria)
        references.append(label.reference)
    columns = {"criteria": criteria}
    if reward.strategy == "reference":
        columns["reference"] = references
    return reward(queries, list(solution_strs), **columns)
