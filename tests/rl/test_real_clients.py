"""The RL adapters driven by the trainers' own code: openrlhf 0.11.2's SingleTurnAgentExecutor and
verl 0.9.1's config and reward loop worker, imported from the real packages (`make install` puts
them in without their GPU stack; tests/stubs.py stands in for ray). Only the policy's generation
(vLLM) is replaced, by an engine that answers with fixed text."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import types

import numpy as np
import pytest
import torch
from helpers import tiny_tokenizer
from hydra import compose, initialize_config_module
from openrlhf.utils import agent as openrlhf_agent
from scorers import export_tiny
from stubs import stubbed

from crm.inference.reward import CRMReward, CRMRewardError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CRITERIA = ["concise answer", "is friendly"]
REFERENCE = "beta reply"
CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def answer_to(question: str) -> str:
    return "alpha reply" + " the a of" * (int(question.split()[-1]) % 4)


class Engine:
    """Stands in for OpenRLHF's vLLM engine: answers each prompt with answer_to(its question)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        prompt = self.tokenizer.decode(prompt_token_ids)
        text = answer_to(prompt.rsplit("<|im_end|>", 1)[0]) + "<|im_end|>"
        ids = self.tokenizer(text=text, add_special_tokens=False)["input_ids"]
        output = types.SimpleNamespace(token_ids=ids, text=text, finish_reason="stop", logprobs=None)
        return types.SimpleNamespace(outputs=[output])


def test_openrlhf_executor_512_concurrent_samples_all_rewarded(openrlhf_server):
    """A rollout batch as OpenRLHF sends it: 512 executions at once, one HTTP request each, with
    left-truncated prompts among them; every one rewarded on the first try, each its own."""
    reward, url = openrlhf_server
    tokenizer = tiny_tokenizer()
    executor = openrlhf_agent.SingleTurnAgentExecutor(remote_rm_url=url)
    retries = []
    handler = logging.Handler()
    handler.emit = lambda record: retries.append(record.getMessage())
    openrlhf_agent.logger.addHandler(handler)
    questions = [f"question {i % 16}" for i in range(512)]
    label = json.dumps({"criteria": CRITERIA, "reference": REFERENCE})  # a dataset column of text

    async def rollout(i):
        prompt = "<|im_start|>system\nbe brief<|im_end|>\n" + CHATML.format(questions[i])
        n = len(tokenizer(text=prompt, add_special_tokens=False)["input_ids"])
        # every 4th prompt is 6 tokens too long: OpenRLHF keeps its last n - 6 tokens
        params = types.SimpleNamespace(max_tokens=24, logprobs=None)
        max_length = n + 24 - (6 if i % 4 == 0 else 0)
        return await executor.execute(prompt, label, params, max_length, tokenizer, Engine(tokenizer))

    async def batch():
        return await asyncio.wait_for(asyncio.gather(*(rollout(i) for i in range(512))), timeout=120)

    try:
        outputs = asyncio.run(batch())
    finally:
        openrlhf_agent.logger.removeHandler(handler)
    distinct = sorted(set(questions))
    expected = dict(zip(distinct, reward(distinct, [answer_to(q) for q in distinct],
                                         criteria=[CRITERIA] * 16, reference=[REFERENCE] * 16)))
    assert not [m for m in retries if "error" in m.lower()]
    # the request's lists, one value each, as OpenRLHF's own serve_rm answers
    assert [o["reward"] for o in outputs] == [pytest.approx([expected[q]], abs=1e-6) for q in questions]
    assert outputs[0]["scores"] == outputs[0]["reward"]
    assert outputs[0]["extra_logs"] == {"crm_reward": outputs[0]["reward"]}


# -- verl ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl():
    """verl's DataProto and RewardLoopWorker, ray stubbed while this module's tests run."""
    with stubbed("ray"):
        from verl import DataProto
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

        yield types.SimpleNamespace(DataProto=DataProto, RewardLoopWorker=RewardLoopWorker)


def verl_config(tmp_path, n: int, *overrides: str):
    """verl's own ppo_trainer config with the settings docs/RL.md gives."""
    tokenizer_dir = tmp_path / "policy"
    tiny_tokenizer().save_pretrained(tokenizer_dir)  # the policy's tokenizer decodes responses
    export = export_tiny(tmp_path / "crm")
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={tokenizer_dir}",
            f"actor_rollout_ref.rollout.n={n}", f"actor_rollout_ref.rollout.val_kwargs.n={n}",
            "reward.reward_manager.source=importlib", "reward.reward_manager.name=CRMRewardManager",
            "reward.reward_manager.module.path=pkg://crm.rl.verl_manager",
            f"+reward.reward_kwargs.checkpoint={export}", "reward.num_workers=1", *overrides])


def rollouts(verl, questions: list[str], responses: list[str], uids: list[str]):
    """A batch as verl's trainer holds it: left-padded prompts, right-padded responses."""
    tok = tiny_tokenizer()
    prompts = [tok(text=CHATML.format(q), add_special_tokens=False)["input_ids"] for q in questions]
    answers = [tok(text=r + "<|im_end|>", add_special_tokens=False)["input_ids"] for r in responses]
    p_len, r_len = max(map(len, prompts)), max(map(len, answers))
    pad = tok.pad_token_id
    prompt_ids = torch.tensor([[pad] * (p_len - len(p)) + p for p in prompts])
    response_ids = torch.tensor([a + [pad] * (r_len - len(a)) for a in answers])
    mask = torch.tensor([[0] * (p_len - len(p)) + [1] * (len(p) + len(a)) + [0] * (r_len - len(a))
                         for p, a in zip(prompts, answers)])
    label = {"criteria": CRITERIA}
    return verl.DataProto.from_dict(
        tensors={"prompts": prompt_ids, "responses": response_ids, "attention_mask": mask,
                 "input_ids": torch.cat([prompt_ids, response_ids], 1)},
        non_tensors={"data_source": np.array(["crm"] * len(questions), dtype=object),
                     "reward_model": np.array([{"ground_truth": label, "style": "model"}] * len(questions),
                                              dtype=object),
                     "extra_info": np.array([{"question": q, "index": i} for i, q in enumerate(questions)],
                                            dtype=object),
                     "uid": np.array(uids, dtype=object)})


def test_verl_reward_loop_scores_whole_groups_round_robin(verl, tmp_path):
    """verl's RewardLoopWorker, built from the config, loads the CRM manager; the agent loop's
    streaming calls (one per rollout, any order) and the colocated batch call both give each
    rollout its round_robin reward over all n = 4 rollouts of its prompt."""
    worker = verl.RewardLoopWorker(verl_config(tmp_path, 4))
    questions = ["question one"] * 4 + ["question two"] * 4
    responses = ["alpha reply", "beta reply", "alpha reply the", "beta", "a", "alpha", "reply of", "the"]
    data = rollouts(verl, questions, responses, ["u1"] * 4 + ["u2"] * 4)
    order = list(range(8))
    random.Random(0).shuffle(order)  # rollouts finish in any order

    async def streamed():
        calls = asyncio.gather(*(worker.compute_score(data[i:i + 1]) for i in order))
        results = await asyncio.wait_for(calls, timeout=60)
        return [results[order.index(i)] for i in range(8)]

    async def colocated():
        return await asyncio.wait_for(worker.compute_score_batch(data), timeout=60)

    expected = CRMReward(tmp_path / "crm")(questions, responses, criteria=[CRITERIA] * 8)
    for results in (asyncio.run(streamed()), asyncio.run(colocated())):
        assert [r["reward_score"] for r in results] == pytest.approx(expected, abs=1e-6)
        assert results[0]["reward_extra_info"] == {"crm_reward": results[0]["reward_score"]}
    assert sum(expected[:4]) == pytest.approx(2.0, abs=1e-6)  # a group of 4: mean 0.5


def test_verl_registry_holds_the_manager_as_crm(verl):
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls

    from crm.rl.verl_manager import CRMRewardManager

    assert get_reward_manager_cls("crm") is CRMRewardManager


def test_verl_group_short_of_a_rollout_is_scored_after_the_timeout(verl, tmp_path):
    """A group that never fills (3 of 4 rollouts) does not hang the step: after group_timeout it
    is scored as it is."""
    worker = verl.RewardLoopWorker(verl_config(tmp_path, 4, "+reward.reward_kwargs.group_timeout=0.2"))
    questions, responses = ["question one"] * 3, ["alpha reply", "beta reply", "alpha reply the"]
    data = rollouts(verl, questions, responses, ["u1"] * 3)

    async def streamed():
        calls = asyncio.gather(*(worker.compute_score(data[i:i + 1]) for i in range(3)))
        return await asyncio.wait_for(calls, timeout=60)

    expected = CRMReward(tmp_path / "crm")(questions, responses, criteria=[CRITERIA] * 3)
    assert [r["reward_score"] for r in asyncio.run(streamed())] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("override,message", [
    ("reward.num_workers=8", "set reward.num_workers=1"),
    ("actor_rollout_ref.rollout.val_kwargs.n=1", "val_kwargs.n=4"),
    ("+reward.reward_kwargs.tmperature=2", "unknown reward.reward_kwargs ['tmperature']"),
])
def test_verl_settings_that_cannot_work_are_refused_at_start(verl, tmp_path, override, message):
    with pytest.raises(CRMRewardError, match=message.replace("[", r"\[").replace("]", r"\]")):
        verl.RewardLoopWorker(verl_config(tmp_path, 4, override))
