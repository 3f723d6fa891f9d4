"""A crm-train run's automatic choices, decided once at start, in one place, and their record.

`compile`, `stream.packing`, `micro_batch_size`, `parallel.sharding` and `parallel.timeout_minutes`
may say `auto`, and a LoRA run records its adapters and base. `resolve` decides all of them from
the run's settings and this machine (the trainer's device, inductor, the GPU's memory), before any
data is read, and refuses what cannot run in one line (ConfigError); its checks run against what
it decided. The answer, `Resolved`, is kept whole in the run config (every checkpoint's
`crm_config`, the export's crm.json, the logger's hyperparameters) and in metrics.json, so that a
run is read back as it ran, never as `auto` (docs/DESIGN.md section 9).

`run` is crm-train's settings object (crm.cli.train.TrainConfig), read by attribute: this layer
does not import the command line.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace
from functools import partial

from crm.core.errors import ConfigError
from crm.training.parallel import ParallelConfig
from crm.training.trainer import batch_plan, device_type, resolve_sharding, world_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resolved:
    compile: bool  # each decoder layer compiled (crm.models.compile)
    packing: bool  # a micro batch is one packed row (crm.models.packing.decide)
    micro_batch_size: int  # records per forward on one rank (crm.training.trainer.batch_plan)
    accumulation: int  # micro batches per optimizer step
    sharding: str  # fsdp | hsdp (crm.perf.network.choose_sharding under auto)
    timeout_minutes: int | float | None  # the process group's (crm.perf.memory under auto)
    lora: dict | None  # the adapters and their base (crm.models.lora.base_record); None: full

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
        run_config["resolved"] = self.record()
        return run_config


def resolve(run) -> Resolved:
    """Every automatic choice of `run` for this machine, in the order each needs the last; the
    model is planned with its configured vocabulary (`model.vocab_size`, before any tokenizer)."""
    from crm.training import checks

    device = device_type(run.trainer)
    compile = compile_layers(run, device)
    checks.check_attention(run.model.attention, compile)
    packing = packed_rows(run, device)
    micro_batch, accumulation = batch_plan(run.global_batch_size, run.micro_batch_size,
                                           world_size(run.trainer), run.max_micro_batch_size)
    parallel = resolve_sharding(run.parallel, run.trainer,
                                partial(choose_sharding, run, run.model.vocab_size, micro_batch,
                                        compile, packing))
    lora = lora_record(run, num_labels=run.transform.num_labels, compiled=compile)
    parallel = resolve_timeout(parallel, run, run.model.vocab_size, lora)
    return Resolved(compile=compile, packing=packing, micro_batch_size=micro_batch,
                    accumulation=accumulation, sharding=parallel.sharding,
                    timeout_minutes=parallel.timeout_minutes, lora=lora)


def compile_layers(run, device: str) -> bool:
    """Whether to compile each decoder layer: `compile` for the trainer's device (auto: on CUDA,
    where inductor can; compile=true where it cannot, and an attention implementation compiled
    layers cannot run, are refused at start)."""
    from crm.models import compile as compiling
    from crm.models.backbone import COMPILABLE_ATTENTION, not_compilable

    try:
        wanted = compiling.decide(run.compile, device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if wanted and run.model.attention not in ("auto", *COMPILABLE_ATTENTION):
        raise ConfigError(not_compilable(run.model.attention))
    return wanted


def packed_rows(run, device: str) -> bool:
    """`stream.packing` for the trainer's device (auto: on CUDA); a wrong value is refused at start."""
    from crm.models import packing

    try:
        return packing.decide(run.stream.packing, device, run.loss.kind)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def choose_sharding(run, vocab_size: int | None, micro_batch: int, compiled: bool, packing: bool,
                    num_nodes: int, devices: int) -> str:
    """parallel.sharding=auto's choice for this run (crm.perf.network.choose_sharding): the memory
    plan at the run's row length, micro batch and packing against this GPU, with every setting
    crm-plan plans it with (its default prompt_share: crm-train does not know its data's), so
    that the two agree; CPU ranks have no device memory to plan against."""
    import torch

    from crm.perf import network
    from crm.perf.flops import model_shape
    from crm.perf.memory import PLANNED_PROMPT_SHARE

    cuda = device_type(run.trainer) == "cuda"
    gib = torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if cuda else math.inf
    return network.choose_sharding(
        model_shape(run.model, run.loss.kind, vocab_size), num_nodes=num_nodes, devices=devices,
        seq_len=run.stream.max_tokens, micro_batch_size=micro_batch, kind=run.loss.kind,
        packing=packing, prompt_share=PLANNED_PROMPT_SHARE,
        activation_checkpointing=run.parallel.activation_checkpointing, compiled=compiled,
        gpu_memory_gib=gib)


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
