"""A crm-train run's automatic choices, decided once at start, in one place, and their record.

Two steps, from typed settings (crm.training.config.StartSettings), each choice made once:
`lay_out` places the run: its device (from the trainer group's accelerator: the one place a run's
device type is derived), its processes and the batch plan over them; it needs no model library,
so the data is checked against it before the second step imports them. `resolve` then decides
the rest for that layout and this machine (inductor, flash-attn, the GPU's memory): `compile`,
`model.attention`, `stream.packing`, `parallel.sharding` and `parallel.timeout_minutes` may say
`auto`, and a LoRA run records its adapters and base; `transform.ties` was decided with the
settings (crm.data.transforms.tie_policy) and is recorded here. What cannot run is refused in
one line (ConfigError). The answer, `Resolved`, is kept whole in the run config (every
checkpoint's `crm_config`, the export's crm.json, the logger's hyperparameters) and in
metrics.json, so that a run is read back as it ran, never as `auto` (docs/DESIGN.md section 9).
crm-plan asks the same two steps for the GPU node it plans (`Environment(this_machine=False)`).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch

from crm.core.errors import ConfigError
from crm.training.config import DeviceSettings, StartSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Where a run goes: decided before any model library is imported."""

    device: str  # cuda | cpu: where the trainer group's accelerator runs the model (device_type)
    world_size: int  # processes: devices per node x nodes
    micro_batch_size: int  # records per forward on one rank (batch_plan)
    accumulation: int  # micro batches per optimizer step


@dataclass(frozen=True)
class Resolved:
    device: str  # Layout's four fields, as laid out
    world_size: int
    micro_batch_size: int
    accumulation: int
    attention: str  # the backbone's attention (crm.models.config.resolve_attention under auto)
    compile: bool  # each decoder layer compiled (crm.models.compile)
    packing: bool  # a micro batch is one packed row (crm.data.config.resolve_packing)
    sharding: str  # fsdp | hsdp (crm.perf.network.choose_sharding under auto)
    timeout_minutes: int | float | None  # the process group's (crm.perf.memory under auto)
    lora: dict | None  # the adapters and their base (crm.models.lora.base_record); None: full
    ties: str  # keep | drop (crm.data.transforms.tie_policy under auto, decided with the settings)

    def record(self) -> dict:
        return asdict(self)

    def into(self, run_config: dict) -> dict:
        """`run_config` (the composed config as a dict) saying what ran: each automatic setting's
        decided value in its place, and this whole record under `resolved`."""
        run_config["compile"] = self.compile
        run_config["micro_batch_size"] = self.micro_batch_size
        run_config["model"]["attention"] = self.attention
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

    device: str  # cuda | cpu: the layout's device
    gpu_memory_gib: float  # one device's memory; inf where there is none to plan against (CPU)
    # Ask this machine whether inductor builds and flash-attn is installed; a planned GPU node is
    # taken to have both (crm-plan runs on a login node).
    this_machine: bool = True

    @classmethod
    def here(cls, device: str) -> Environment:
        if device != "cuda":
            return cls(device, math.inf)
        return cls(device, torch.cuda.get_device_properties(0).total_memory / 2 ** 30)


def lay_out(settings: StartSettings, device: str | None = None) -> Layout:
    """The run's device, processes and batch plan; `device`: a planned node's, not this machine's
    (crm-plan). The commonest refusals (a batch that does not divide, a GPU that is not there)
    come here, before any model library is imported."""
    device = device or device_type(settings.devices)
    world = world_size(settings.devices, device)
    batch = settings.batch
    micro_batch, accumulation = batch_plan(batch.global_batch_size, batch.micro_batch_size, world,
                                           batch.max_micro_batch_size)
    return Layout(device, world, micro_batch, accumulation)


def resolve(settings: StartSettings, layout: Layout | None = None,
            environment: Environment | None = None) -> Resolved:
    """Every automatic choice of the run `settings` state, for `layout` (default: `lay_out`'s)
    on `environment` (default: this machine), in the order each needs the last; the model is
    planned with its configured vocabulary (`model.vocab_size`, before any tokenizer)."""
    layout = layout or lay_out(settings, environment and environment.device)
    env = environment or Environment.here(layout.device)
    lora = lora_record(settings)
    if env.this_machine:  # asks this machine: imports inductor's builder and transformers
        from crm.models.backbone import choose_attention
        from crm.models.compile import decide as decide_compile
    else:
        from crm.models.config import resolve_compile as decide_compile

        choose_attention = planned_attention
    from crm.data.config import resolve_packing

    try:  # a value the device or this machine cannot take: one line, from the layer that knows
        compile = decide_compile(settings.compile, env.device)
        packing = resolve_packing(settings.packing, env.device, settings.loss.kind)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        attention = choose_attention(settings.model.attention, compile, env.device)
    except ValueError as exc:
        raise ConfigError(f"model.{exc}") from None
    sharding = resolve_sharding(settings.parallel.sharding, settings.devices, layout.world_size,
                                partial(choose_sharding, settings, settings.model.vocab_size,
                                        layout.micro_batch_size, compile, packing,
                                        env.gpu_memory_gib))
    return Resolved(**asdict(layout), attention=attention, compile=compile, packing=packing,
                    sharding=sharding, timeout_minutes=resolve_timeout(settings, lora), lora=lora,
                    ties=settings.transform.ties)


def planned_attention(requested: str, compiled: bool, device: str) -> str:
    """The attention a planned GPU node takes: flash-attn counted as installed there."""
    from crm.models.config import resolve_attention

    return resolve_attention(requested, compiled, device, flash_installed=True)[0]


def device_type(devices: DeviceSettings) -> str:
    """"cuda" or "cpu": where the trainer group's accelerator runs the model; a GPU asked for
    where there is none is refused."""
    accelerator = devices.accelerator
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator}: no CUDA device on this machine "
                          "(torch.cuda.is_available() is False); use trainer=cpu")
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "cuda" if gpu else "cpu"


def world_size(devices: DeviceSettings, device: str) -> int:
    """Processes of the run: devices per node x nodes (`devices: auto` counts the visible GPUs)."""
    count = devices.devices
    if count in ("auto", -1, "-1"):
        count = torch.cuda.device_count() if device == "cuda" else 1
        if not count:
            raise ConfigError(f"trainer.devices={devices.devices} with trainer.accelerator="
                              f"{devices.accelerator}, but no CUDA device is visible")
    elif isinstance(count, (list, tuple)):
        count = len(count)
    return int(count) * devices.num_nodes


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


def resolve_sharding(sharding: str, devices: DeviceSettings, world: int,
                     choose: Callable[[int, int], str]) -> str:
    """`parallel.sharding` decided: under FSDP, auto is `choose(nodes, ranks per node)`
    (crm.perf.network.choose_sharding's rule); fsdp for any other strategy."""
    if sharding != "auto":
        return sharding
    if devices.strategy != "fsdp":  # nothing is sharded: nothing to say
        return "fsdp"
    nodes = devices.num_nodes
    choice = choose(nodes, world // nodes)
    log.info("parallel.sharding=auto: %s (%d node(s) x %d rank(s))", choice, nodes, world // nodes)
    return choice


def choose_sharding(settings: StartSettings, vocab_size: int | None, micro_batch: int,
                    compiled: bool, packing: bool, gpu_memory_gib: float, num_nodes: int,
                    devices: int) -> str:
    """parallel.sharding=auto's choice for this run (crm.perf.network.choose_sharding): the memory
    plan at the run's row length, micro batch and packing against this GPU, with every setting
    crm-plan plans it with (its default prompt_share: crm-train does not know its data's), so
    that the two agree; CPU ranks have no device memory to plan against (inf)."""
    from crm.perf import network
    from crm.perf.flops import model_shape
    from crm.perf.memory import PLANNED_PROMPT_SHARE

    return network.choose_sharding(
        model_shape(settings.model, settings.loss.kind, vocab_size), num_nodes=num_nodes,
        devices=devices, seq_len=settings.max_tokens, micro_batch_size=micro_batch,
        kind=settings.loss.kind, packing=packing, prompt_share=PLANNED_PROMPT_SHARE,
        activation_checkpointing=settings.parallel.activation_checkpointing, compiled=compiled,
        gpu_memory_gib=gpu_memory_gib)


def lora_record(settings: StartSettings) -> dict | None:
    """A LoRA run's record of its adapters and base (crm.models.lora.base_record), after checking
    on the meta device that the model has the target modules; None for full training. The
    trained count (adapters + head) does not depend on the vocabulary: the embeddings are frozen."""
    lora, model = settings.lora, settings.model
    if not lora.enabled:
        return None
    from crm.models.factory import build_crm
    from crm.models.lora import base_record, trainable_counts

    try:  # shapes only, which neither the attention nor compiling changes: a model without the
        # target modules stops here, before the trainer starts
        counts = trainable_counts(build_crm(replace(model, attention="sdpa"), settings.loss,
                                            num_labels=settings.transform.num_labels, pad_token_id=0,
                                            vocab_size=model.vocab_size, device="meta", lora=lora))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    log.info("LoRA rank %d on %s: %d of %d parameters trained (%.2f%%, adapters + head)",
             lora.rank, ", ".join(lora.target_modules), counts["trainable"],
             counts["total"], 100 * counts["trainable"] / counts["total"])
    return {**base_record(lora, model.path), "trainable_parameters": counts["trainable"]}


def resolve_timeout(settings: StartSettings, lora: dict | None) -> int | float:
    """`parallel.timeout_minutes` decided: auto is sized for this model and nodes
    (crm.perf.memory.process_group_timeout_minutes, as crm-plan recommends it)."""
    if settings.parallel.timeout_minutes != "auto":
        return settings.parallel.timeout_minutes
    from crm.perf.flops import model_shape
    from crm.perf.memory import process_group_timeout_minutes

    return process_group_timeout_minutes(
        model_shape(settings.model, settings.loss.kind, settings.model.vocab_size),
        num_nodes=settings.devices.num_nodes,
        trained_params=lora["trainable_parameters"] if lora else None)
