"""crm-train's parallel.sharding=auto and crm-plan's plan of the same run (the overrides that
launch/train.sbatch hands crm-plan: crm.cli.train.run_plan_arguments) decide alike, at every point
of a grid of model sizes x nodes x micro batch x row length x packing x checkpointing (pointwise:
where packing changes a record's tokens), on 8 GPUs of 80 GiB per node."""
from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module

import crm.cli.plan  # noqa: F401  (registers the schema)
import crm.cli.train as train_cli
from crm.cli.schema import settings
from crm.perf import flops
from crm.perf import plan as planning
from crm.perf.memory import PLANNED_PROMPT_SHARE
from crm.training import resolve as resolving

GPU_GIB, DEVICES = 80, 8
MODELS = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"]
GRID = list(itertools.product(MODELS, [2, 4], [1, 3], [2048, 8192], [True, False], [True, False]))


def train_overrides(model: str, nodes: int = 2, micro: int = 1, tokens: int = 2048,
                    packing: bool = True, checkpointing: bool = False) -> list[str]:
    return [f"model={model}", "loss=ranking", "trainer=fsdp", f"trainer.num_nodes={nodes}",
            f"trainer.devices={DEVICES}", f"micro_batch_size={micro}", f"stream.max_tokens={tokens}",
            f"stream.packing={str(packing).lower()}",
            f"parallel.activation_checkpointing={str(checkpointing).lower()}", "data=shards",
            "data.path=/shards"]


def both(overrides: list[str]):
    """(crm-train's settings, crm-plan's for the same run on its cluster shape)."""
    arguments = train_cli.run_plan_arguments(overrides)
    run_args = dict(a.split("=", 1) for a in overrides)
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        run = settings(compose("train", overrides=overrides))
        plan = settings(compose("plan", overrides=[
            *arguments, f"trainer.num_nodes={run_args['trainer.num_nodes']}",
            f"trainer.devices={DEVICES}", f"micro_batch_size={run_args['micro_batch_size']}",
            f"gpu_memory_gib={GPU_GIB}"]))
    return run, plan


@pytest.fixture
def an_80_gib_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",  # the GPU crm-plan is told of
                        lambda device: SimpleNamespace(total_memory=GPU_GIB * 2 ** 30))
    # A model's shape is the same at every point: built once per size (the test's time, not crm's)
    monkeypatch.setattr(flops, "model_shape", functools.cache(flops.model_shape))


@pytest.mark.parametrize("point", [dict(model="qwen3-8b", micro=3, packing=True),
                                   dict(model="qwen3-1.7b", tokens=8192, packing=False,
                                        checkpointing=True)])
def test_crm_plan_is_handed_every_setting_the_sharding_depends_on(point):
    run, plan = both(train_overrides(**point))
    assert plan.seq_len == run.stream.max_tokens and plan.kind == run.loss.kind
    assert plan.packing == point["packing"] and plan.compile is True  # a GPU run's auto
    assert plan.activation_checkpointing == run.parallel.activation_checkpointing
    assert plan.sharding == run.parallel.sharding and plan.model.name == run.model.name
    assert plan.prompt_share == PLANNED_PROMPT_SHARE  # crm-plan's default is crm-train's plan


def test_crm_train_and_crm_plan_choose_the_same_sharding_on_a_grid(an_80_gib_gpu):
    """The issue's case among them: qwen3-8b, 2 nodes x 8, micro batch 3, 2,048 tokens, packed,
    no checkpointing (crm-train said fsdp, crm-plan hsdp)."""
    composed = {model: both(train_overrides(model)) for model in MODELS}
    choices = {"hsdp": 0, "fsdp": 0}
    for model, nodes, micro, tokens, packing, checkpointing in GRID:
        run, plan = composed[model]
        run = replace(run, trainer={**run.trainer, "num_nodes": nodes},
                      stream=replace(run.stream, max_tokens=tokens, packing=packing),
                      parallel=replace(run.parallel, activation_checkpointing=checkpointing))
        plan = replace(plan, seq_len=tokens, packing=packing, micro_batch_size=micro,
                       activation_checkpointing=checkpointing)
        by_train = resolving.choose_sharding(run, None, micro, True, packing, nodes, DEVICES)
        by_plan = planning.resolve_sharding(flops.model_shape(plan.model, plan.kind), plan, nodes,
                                            DEVICES)
        assert by_train == by_plan, (model, nodes, micro, tokens, packing, checkpointing)
        choices[by_train] += 1
    assert choices["hsdp"] and choices["fsdp"]  # the grid crosses the boundary
