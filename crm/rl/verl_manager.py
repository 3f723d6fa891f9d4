"""A CRM as verl's reward manager (verl 0.9.x's reward loop), loaded by verl from its settings:

    reward.reward_manager.source=importlib
    reward.reward_manager.name=CRMRewardManager
    reward.reward_manager.module.path=pkg://crm.rl.verl_manager
    +reward.reward_kwargs.checkpoint=/path/to/crm/export
    reward.num_workers=1

Checked against verl 0.9.1: verl/trainer/ppo/reward.py `resolve_reward_manager_cls` loads the class
from `module.path` (`pkg://` imports the module) and `load_reward_manager` builds it as
`cls(config=, tokenizer=, compute_score=, reward_router_address=, reward_model_tokenizer=)`;
verl/experimental/reward_loop/reward_loop.py `RewardLoopWorker.compute_score` awaits
`run_single(data)` once per sample, many at a time in one event loop, and takes
`{"reward_score": float, "reward_extra_info": {...}}`; the agent loop (verl/experimental/agent_loop/
agent_loop.py `_compute_score`) streams each finished rollout to a random one of
`reward.num_workers` workers, its dataset fields (`reward_model`, `extra_info`, `uid`) in
`non_tensor_batch`. The class is also in verl's registry as "crm", for a program that imports
this module before verl reads its config.

A sample's label is `reward_model.ground_truth` (crm/rl/labels.py); the user's query is its
`query`, else `extra_info["question"]`. The response is decoded without special tokens.
Concurrent samples are scored together (crm/rl/batching.py). `round_robin` (the default for a
pairwise CRM) waits for every rollout of a prompt (its `uid`; `actor_rollout_ref.rollout.n` of
them) and scores the group at once, so it needs them all in one worker: `reward.num_workers=1`.
`reward_kwargs` may also set `strategy`, `tau`, `log_odds`, `batch_size`, `batch_wait` and
`group_timeout` (seconds a group waits for its last rollout before it is scored as it is).
"""
from __future__ import annotations

import asyncio
import logging

from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from crm.inference.reward import CRMReward, CRMRewardError
from crm.rl.batching import MicroBatcher
from crm.rl.labels import parse_label

log = logging.getLogger("crm.rl.verl")
SETTINGS = {"checkpoint", "strategy", "tau", "log_odds", "batch_size", "batch_wait", "group_timeout"}


@register("crm")
class CRMRewardManager(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None,
                 reward_model_tokenizer=None, **_):
        super().__init__(config, tokenizer, compute_score)
        settings = dict(config.reward.get("reward_kwargs") or {})
        if "checkpoint" not in settings:
            raise CRMRewardError("no CRM: set +reward.reward_kwargs.checkpoint=PATH (an export or a "
                                 "checkpoint crm-train wrote)")
        unknown = set(settings) - SETTINGS
        if unknown:
            raise CRMRewardError(f"unknown reward.reward_kwargs {sorted(unknown)}; known: {sorted(SETTINGS)}")
        self.reward = CRMReward(str(settings["checkpoint"]), settings.get("strategy"),
                                tau=float(settings.get("tau", 1.0)),
                                log_odds=bool(settings.get("log_odds", False)),
                                batch_size=int(settings.get("batch_size", 32)))
        rollout = config.actor_rollout_ref.rollout
        self.group_size = int(rollout.n)
        self.group_timeout = float(settings.get("group_timeout", 600))
        if self.reward.strategy == "round_robin":
            if int(config.reward.num_workers) != 1:
                raise CRMRewardError(
                    f"round_robin compares all {self.group_size} rollouts of a prompt, and verl sends "
                    f"each rollout to a random one of reward.num_workers={config.reward.num_workers} "
                    "workers: set reward.num_workers=1")
            if int(rollout.val_kwargs.n) != self.group_size:
                raise CRMRewardError(
                    f"round_robin groups validation rollouts too: set actor_rollout_ref.rollout."
                    f"val_kwargs.n={self.group_size} (now {rollout.val_kwargs.n}), or strategy=reference")
        self.batcher = MicroBatcher(self._score, float(settings.get("batch_wait", 0.01)))
        self.groups: dict[str, list] = {}  # uid -> [(sample, future)] still waiting for rollouts

    async def run_single(self, data) -> dict:
        item = data[-1]  # a multi-turn output: the reward is the last sequence's, as verl's own
        response_ids = item.batch["responses"]
        valid = int(item.batch["attention_mask"][-response_ids.shape[-1]:].sum())
        loop = asyncio.get_running_loop()  # verl's worker loop; not the one verl's base class saw
        response = await loop.run_in_executor(
            None, lambda: self.tokenizer.decode(response_ids[:valid], skip_special_tokens=True))
        fields = item.non_tensor_batch
        label = parse_label((fields.get("reward_model") or {}).get("ground_truth"), 0)
        query = label.query or (fields.get("extra_info") or {}).get("question")
        if not isinstance(query, str) or not query:
            raise CRMRewardError('no query: put it in the ground truth ({"criteria": [...], "query": '
                                 '"..."}) or in extra_info["question"]')
        if self.reward.strategy == "reference" and label.reference is None:
            raise CRMRewardError('strategy reference needs the ground truth\'s "reference" answer')
        sample = (query, response, label.criteria, label.reference)
        if self.reward.strategy == "round_robin":
            value = await self._in_group(str(fields.get("uid", (query, tuple(label.criteria)))), sample)
        else:
            value = (await self.batcher([sample]))[0]
        return {"reward_score": value, "reward_extra_info": {"crm_reward": value}}

    async def _in_group(self, uid: str, sample) -> float:
        """Wait for the prompt's other rollouts, then score the group in one call."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        members = self.groups.setdefault(uid, [])
        members.append((sample, future))
        if len(members) == self.group_size:
            self._score_group(uid)
        elif len(members) == 1:
            loop.call_later(self.group_timeout, self._late_group, uid)
        return await future

    def _late_group(self, uid: str) -> None:
        if uid in self.groups:
            log.warning("group %s: %d of %d rollouts after %.0f s; scored as it is", uid,
                        len(self.groups[uid]), self.group_size, self.group_timeout)
            self._score_group(uid)

    def _score_group(self, uid: str) -> None:
        members = self.groups.pop(uid)

        async def score():
            try:
                values = await self.batcher([m[0] for m in members])
            except Exception as exc:
                for _, future in members:
                    future.set_exception(exc)
                return
            for (_, future), value in zip(members, values):
                future.set_result(value)

        asyncio.get_running_loop().create_task(score())

    def _score(self, samples: list) -> list[float]:
        if not samples:
            return []
        columns = {"criteria": [s[2] for s in samples]}
        if self.reward.strategy == "reference":
            columns["reference"] = [s[3] for s in samples]
        return self.reward([s[0] for s in samples], [s[1] for s in samples], **columns)
