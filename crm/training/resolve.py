"""A crm-train run's automatic choices, decided once at start, in one place, and their record.

`compile`, `stream.packing`, `micro_batch_size`, `parallel.sharding`, `parallel.timeout_minutes`
and `transform.ties` may say `auto`, and a LoRA run records its adapters and base. `resolve`
decides them from the run's settings and this machine (the trainer's device, inductor, the GPU's
memory), before any data is read (`transform.ties` with the settings themselves,
crm.data.transforms.tie_policy), and refuses what cannot run in one line (ConfigError); its
checks run against what it decided. The answer, `Resolved`, is kept whole in the run config
(every checkpoint's `crm_config`, the export's crm.json, the logger's hyperparameters) and in
metrics.json, so that a run is read back as it ran, never as `auto` (docs/DESIGN.md section 9).

`run` is crm-train's settings object (crm.cli.train.TrainConfig), read by attribute: this layer
does not import the command line.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch

from crm.core.errors import ConfigError
from crm.training.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resolved:
    compile: bool  # each decoder layer compiled (crm.models.compile)
    packing: bool  # a micro batch is one packed row (crm.data.config.resolve_packing)
    micro_batch_size: int  # records per forward on one rank (batch_plan)
    accumulation: int  # micro batches per optimizer step
    sharding: str  # fsdp | hsdp (crm.perf.network.choose_sharding under auto)
    timeout_minutes: int | float | None  # the process group's (crm.perf.memory under auto)
    lora: dict | None  # the adapters and their base (crm.models.lora.base_record); None: full
    ties: str  # keep | drop (crm.data.transforms.tie_policy under auto, decided with the settings)

    def record(self) -> dict:
        return asdict(self)

    def parallel(self, settings: ParallelConfig) -> ParallelConfig:
        """The `parallel` section as it runs: sharding and timeout decided."""
        return replace(settings, sharding=self.sharding, timeout_minutes=self.timeout_minutes)

    def into(self, run_config: dict) -> dict:
        """`run_config` (the composed config as a dict) saying what ran: each automatic setting's
        decided value in its place, and this whole record under `resolved`."""
        run_config["compile"] = self.compile
        run_config["micro_batch_size"] = self.micro_batch_size
        run_config["stream"]["packing"] = self.packing
        run_config["parallel"]["sharding"] = self.sharding
        run_config["parallel"]["timeout_minutes"] = self.timeout_minutes
        run_config["transform"]["ties"] = self.ties
        run_config["resolved"] = self.record()
        return run_config


@dataclass(frozen=True)
class Environment:
    """The machine the choices are made for: this one at crm-train's start (`here`), or the GPU
    node crm-plan plans for, which is not asked anything (`this_machine=False`)."""

    device: str  # cuda | cpu: where the trainer group's accelerator runs the model
    gpu_memory_gib: float  # one device's memory; inf where there is none to plan against (CPU)
    # Ask this machine whether inductor builds and flash-attn is installed; a planned GPU node is
    # taken to have both (crm-plan runs on a login node).
    this_machine: bool = True

    @classmethod
    def here(cls, trainer: dict) -> Environment:
        device = device_type(trainer)
        if device != "cuda":
            return cls(device, math.inf)
        return cls(device, torch.cuda.get_device_properties(0).total_memory / 2 ** 30)


def resolve(run, environment: Environment | None = None) -> Resolved:
    """Every automatic choice of `run` for `environment` (default: this machine), in the order each
    needs the last; the model is planned with its configured vocabulary (`model.vocab_size`, before
    any tokenizer). crm-plan asks the same question for the node it plans (crm.cli.plan)."""
    from crm.training import checks

    env = environment or Environment.here(run.trainer)
    # First, as it needs neither the model's modules nor the compiler: the commonest refusal
    # comes before transformers' import (1.5 s of a refusal's 4.4).
    micro_batch, accumulation = batch_plan(run.global_batch_size, run.micro_batch_size,
                                           world_size(run.trainer), run.max_micro_batch_size)
    compile = compile_layers(run, env)
    if env.this_machine:
        checks.check_attention(run.model.attention, compile)
    packing = packed_rows(run, env.device)
    parallel = resolve_sharding(run.parallel, run.trainer,
                                partial(choose_sharding, run, run.model.vocab_size, micro_batch,
                                        compile, packing, env.gpu_memory_gib))
    lora = lora_record(run, num_labels=run.transform.num_labels, compiled=compile)
    parallel = resolve_timeout(parallel, run, run.model.vocab_size, lora)
    return Resolved(compile=compile, packing=packing, micro_batch_size=micro_batch,
                    accumulation=accumulation, sharding=parallel.sharding,
                    timeout_minutes=parallel.timeout_minutes, lora=lora, ties=run.transform.ties)


def device_type(trainer: dict) -> str:
    """"cuda" or "cpu": where the trainer group's accelerator runs the model."""
    accelerator = trainer["accelerator"]
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "cuda" if gpu else "cpu"


def world_size(trainer: dict) -> int:
    """Processes of the run: devices per node x nodes (`devices: auto` counts the visible GPUs)."""
    devices = trainer["devices"]
    if devices in ("auto", -1, "-1"):
        devices = torch.cuda.device_count() if device_type(trainer) == "cuda" else 1
        if not devices:
            raise ConfigError(f"trainer.devices={trainer['devices']} with trainer.accelerator="
                             f"{trainer['accelerator']}, but no CUDA device is visible")
    elif isinstance(devices, (list, tuple)):
        devices = len(devices)
    return int(devices) * int(trainer.get("num_nodes", 1))


def batch_plan(global_batch: int, micro_batch: int | str, world: int,
               max_micro_batch: int) -> tuple[int, int]:
    """(micro batch, accumulation) for `global_batch` records per optimizer step over `world` ranks.

    `micro_batch="auto"`: the largest micro batch that divides a rank's share of the global batch,
    at most `max_micro_batch` (the memory bound), so the same config runs on any world size.
    """
    if micro_batch == "auto":
        if global_batch % world:
            raise ConfigError(f"global_batch_size={global_batch} cannot be split over {world} ranks; "
                              "make it a multiple of the number of ranks")
        per_rank = global_batch // world
        micro_batch = max(m for m in range(1, min(per_rank, max_micro_batch) + 1) if per_rank % m == 0)
    per_step = int(micro_batch) * world
    if global_batch % per_step:
        raise ConfigError(f"global_batch_size={global_batch} is not a multiple of micro_batch_size="
                          f"{micro_batch} x {world} ranks; accumulation must be a whole number "
                          "(micro_batch_size=auto finds one)")
    return int(micro_batch), global_batch // per_step


def resolve_sharding(parallel: ParallelConfig, trainer: dict,
                     choose: Callable[[int, int], str]) -> ParallelConfig:
    """`parallel` with `sharding: auto` decided: under FSDP, `choose(nodes, ranks per node)`
    (crm.perf.network.choose_sharding's rule); fsdp for any other strategy."""
    if parallel.sharding != "auto":
        return parallel
    nodes = int(trainer.get("num_nodes", 1))
    per_node = world_size(trainer) // nodes
    if trainer.get("strategy") != "fsdp":  # nothing is sharded: nothing to say
        return replace(parallel, sharding="fsdp")
    choice = choose(nodes, per_node)
    log.info("parallel.sharding=auto: %s (%d node(s) x %d rank(s))", choice, nodes, per_node)
    return replace(parallel, sharding=choice)


def compile_layers(run, env: Environment) -> bool:
    """Whether to compile each decoder layer: `compile` for the trainer's device (auto: on CUDA,
    where inductor can; compile=true where it cannot, and an attention implementation compiled
    layers cannot run, are refused at start). A planned node is not asked for its compiler."""
    from crm.models.config import COMPILABLE_ATTENTION, not_compilable, resolve_compile

    if env.this_machine:  # asks this machine's compiler: imports inductor's builder and the model
        from crm.models.compile import decide
    else:
        decide = resolve_compile
    try:
        wanted = decide(run.compile, env.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if wanted and run.model.attention not in ("auto", *COMPILABLE_ATTENTION):
        raise ConfigError(not_compilable(run.model.attention))
    return wanted


def packed_rows(run, device: str) -> bool:
    """`stream.packing` for the trainer's device (auto: on CUDA); a wrong value is refused at start."""
    from crm.data.config import resolve_packing

    try:
        return resolve_packing(run.stream.packing, device, run.loss.kind)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def choose_sharding(run, vocab_size: int | None, micro_batch: int, compiled: bool, packing: bool,
                    gpu_memory_gib: float, num_nodes: int, devices: int) -> str:
    """parallel.sharding=auto's choice for this run (crm.perf.network.choose_sharding): the memory
    plan at the run's row length, micro batch and packing against this GPU, with every setting
    crm-plan plans it with (its default prompt_share: crm-train does not know its data's), so
    that the two agree; CPU ranks have no device memory to plan against (inf)."""
    from crm.perf import network
    from crm.perf.flops import model_shape
    from crm.perf.memory import PLANNED_PROMPT_SHARE

    return network.choose_sharding(
        model_shape(run.model, run.loss.kind, vocab_size), num_nodes=num_nodes, devices=devices,
        seq_len=run.stream.max_tokens, micro_batch_size=micro_batch, kind=run.loss.kind,
        packing=packing, prompt_share=PLANNED_PROMPT_SHARE,
        activation_checkpointing=run.parallel.activation_checkpointing, compiled=compiled,
        gpu_memory_gib=gpu_memory_gib)


def lora_record(run, *, num_labels: int, compiled: bool) -> dict | None:
    """A LoRA run's record of its adapters and base (crm.models.lora.base_record), after checking
    on the meta device that the model has the target modules; None for full training. The
    trained count (adapters + head) does not depend on the vocabulary: the embeddings are frozen."""
    if not run.lora.enabled:
        return None
    from crm.models.factory import build_crm
    from crm.models.lora import base_record, trainable_counts

    try:  # shapes only: a model without the target modules stops here, before the trainer starts
        counts = trainable_counts(build_crm(run.model, run.loss, num_labels=num_labels, pad_token_id=0,
                                            vocab_size=run.model.vocab_size, device="meta",
                                            compiled=compiled, lora=run.lora))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    log.info("LoRA rank %d on %s: %d of %d parameters trained (%.2f%%, adapters + head)",
             run.lora.rank, ", ".join(run.lora.target_modules), counts["trainable"],
             counts["total"], 100 * counts["trainable"] / counts["total"])
    return {**base_record(run.lora, run.model.path), "trainable_parameters": counts["trainable"]}


def resolve_timeout(parallel: ParallelConfig, run, vocab_size: int | None,
                    lora: dict | None) -> ParallelConfig:
    """`parallel` with `timeout_minutes: auto` decided for this model and nodes
    (crm.perf.memory.process_group_timeout_minutes, as crm-plan recommends it)."""
    if parallel.timeout_minutes != "auto":
        return parallel
    from crm.perf.flops import model_shape
    from crm.perf.memory import process_group_timeout_minutes

    minutes = process_group_timeout_minutes(
        model_shape(run.model, run.loss.kind, vocab_size),
        num_nodes=int(run.trainer.get("num_nodes", 1)),
        trained_params=lora["trainable_parameters"] if lora else None)
    return replace(parallel, timeout_minutes=minutes)
