"""crm-train's parallel.sharding=auto and crm-plan's plan of the same run (the overrides that
launch/train.sbatch hands crm-plan: crm.cli.train.run_plan_arguments) decide alike, at every point
of a grid of model sizes x nodes x micro batch x row length x packing x checkpointing (pointwise:
where packing changes a record's tokens), on 8 GPUs of 80 GiB per node."""
from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_module

import crm.cli.plan as plan_cli
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
                    packing: bool = True, checkpointing: bool = False, loss: str = "ranking",
                    lora_rank: int = 0, global_batch: int | None = None) -> list[str]:
    batch = [] if global_batch is None else [f"global_batch_size={global_batch}"]
    return [*batch, f"model={model}", f"loss={loss}", "trainer=fsdp", f"trainer.num_nodes={nodes}",
            f"trainer.devices={DEVICES}", f"micro_batch_size={micro}", f"stream.max_tokens={tokens}",
            f"stream.packing={str(packing).lower()}",
            f"parallel.activation_checkpointing={str(checkpointing).lower()}", "data=shards",
            "data.path=/shards", f"lora.rank={lora_rank}"]


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


@pytest.mark.parametrize("point", [
    dict(model="qwen3-8b", micro=3, packing=True, global_batch=96),  # hsdp
    dict(model="qwen3-1.7b", tokens=8192, packing=False, checkpointing=True),
    dict(model="qwen3-0.6b", nodes=1, micro=2, loss="cls", lora_rank=16),  # pairwise, LoRA, one node
])
def test_crm_plan_prints_the_resolution_crm_train_records(point, shapes_once):
    """crm-plan's `resolved` (crm.cli.plan.planned_resolution, what it prints and writes to
    plan.json) is crm.training.resolve.resolve's record of crm-train's run for the same overrides,
    on the GPU node the plan is told of: every field, the LoRA record included."""
    run, plan = both(train_overrides(**point))
    node = resolving.Environment(device="cuda", gpu_memory_gib=GPU_GIB, this_machine=False)
    by_train = resolving.resolve(run.start_settings(), environment=node).record()
    assert plan_cli.planned_resolution(plan) == by_train
    assert by_train["compile"] and by_train["packing"] == point.get("packing", True)
    assert by_train["micro_batch_size"] == point.get("micro", 1)
    assert (by_train["lora"] is not None) == bool(point.get("lora_rank"))


@pytest.fixture
def shapes_once(monkeypatch):
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


def test_crm_train_and_crm_plan_choose_the_same_sharding_on_a_grid(shapes_once):
    """The issue's case among them: qwen3-8b, 2 nodes x 8, micro batch 3, 2,048 tokens, packed,
    no checkpointing (crm-train said fsdp, crm-plan hsdp)."""
    composed = {model: both(train_overrides(model)) for model in MODELS}
    choices = {"hsdp": 0, "fsdp": 0}
    for model, nodes, micro, tokens, packing, checkpointing in GRID:
        run, plan = composed[model]
        run = replace(run.start_settings(), max_tokens=tokens, packing=packing,
                      parallel=replace(run.parallel, activation_checkpointing=checkpointing))
        plan = replace(plan, seq_len=tokens, packing=packing, micro_batch_size=micro,
                       activation_checkpointing=checkpointing)
        by_train = resolving.choose_sharding(run, None, micro, True, packing, GPU_GIB, nodes,
                                             DEVICES)
        by_plan = planning.resolve_sharding(flops.model_shape(plan.model, plan.kind), plan, nodes,
                                            DEVICES)
        assert by_train == by_plan, (model, nodes, micro, tokens, packing, checkpointing)
        choices[by_train] += 1
    assert choices["hsdp"] and choices["fsdp"]  # the grid crosses the boundary
