"""The training layer's settings as a user writes them: crm-train's `optim`, `parallel` and
`logger` sections (configs/train.yaml, configs/parallel, configs/logger), read by crm.training.module,
crm.training.parallel and crm.training.loggers; and `StartSettings`, the part of a run that
crm.training.resolve decides its automatic choices from.

Plain Python, no torch or Lightning: a command composes and checks its config before loading them
(crm.models.config says why).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from crm.data.transforms import TransformSettings
from crm.models.config import LoraConfig, LossConfig, ModelConfig


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3  # peak learning rate, reached after warmup
    weight_decay: float = 0.01  # AdamW decay on matrices; norms and biases are not decayed
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100  # linear warmup, then cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        # torch's AdamW refuses these only when the optimizer is built: after the tokenizer is
        # trained, inside fit, as a traceback.
        beta1, beta2 = self.betas
        for key, ok, wanted in (("lr", self.lr > 0, "> 0"), ("eps", self.eps >= 0, ">= 0"),
                                ("weight_decay", self.weight_decay >= 0, ">= 0"),
                                ("betas", 0 <= beta1 < 1 and 0 <= beta2 < 1, "each in [0, 1)"),
                                ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
                                ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]")):
            if not ok:
                value = list(self.betas) if key == "betas" else getattr(self, key)
                raise ValueError(f"optim.{key}={value}: expected {wanted}")


SHARDINGS = ("auto", "fsdp", "hsdp")
GRAD_SYNCS = ("step", "micro_batch")


@dataclass(frozen=True)
class ParallelConfig:
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (any strategy)
    param_dtype: str = "bfloat16"  # FSDP: dtype of the all-gathered parameters for compute
    reduce_dtype: str = "float32"  # FSDP: dtype of the gradient reduce-scatter
    reshard_after_forward: bool = True  # FSDP: free gathered layers after forward (ZeRO-3)
    sharding: str = "auto"  # FSDP over all ranks (fsdp) or within each node, replicated across (hsdp)
    grad_sync: str = "step"  # under accumulation: reduce gradients once per step, or every micro batch
    # The longest a rank may wait in a collective before its watchdog aborts the run: auto = sized
    # for a checkpoint save at the model size (crm.perf.memory.process_group_timeout_minutes).
    timeout_minutes: Any = "auto"  # auto or minutes; Any: a str or an int

    def __post_init__(self):
        for key, value, allowed in (("sharding", self.sharding, SHARDINGS),
                                    ("grad_sync", self.grad_sync, GRAD_SYNCS)):
            if value not in allowed:
                raise ValueError(f"parallel.{key}={value}: expected one of {', '.join(allowed)}")
        minutes = self.timeout_minutes
        if minutes != "auto" and not (isinstance(minutes, int) and not isinstance(minutes, bool)
                                      and minutes > 0):
            raise ValueError(f"parallel.timeout_minutes={minutes}: expected auto or a number of "
                             "minutes > 0")

    @property
    def timeout(self) -> timedelta | None:
        """The process groups' timeout; None (torch's default) while `auto` is undecided."""
        return None if self.timeout_minutes == "auto" else timedelta(minutes=self.timeout_minutes)


LOGGERS = ("csv", "wandb", "none")


@dataclass(frozen=True)
class LoggerConfig:
    """crm-train's logger group (configs/logger/*.yaml); the rest of the fields are wandb's."""

    name: str = "csv"  # csv | wandb | none
    project: str = "crm"
    entity: str | None = None
    group: str | None = None  # sweeps set this so the UI groups their runs
    tags: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.name not in LOGGERS:
            raise ValueError(f"logger {self.name!r}: expected one of {', '.join(LOGGERS)}")


@dataclass(frozen=True)
class DeviceSettings:
    """Where a run goes: the trainer group's keys that place it (Lightning's Trainer arguments,
    with Lightning's defaults), read by crm.training.resolve.lay_out."""

    accelerator: str = "auto"  # cpu | gpu | cuda | auto (a GPU where one is visible)
    devices: Any = "auto"  # processes per node: a count, a list of device ids, or auto (-1)
    num_nodes: int = 1
    strategy: Any = "auto"  # fsdp (crm's FSDP2), ddp, auto, ...

    @classmethod
    def of(cls, trainer: Mapping) -> DeviceSettings:
        devices = trainer.get("devices", "auto")
        if isinstance(devices, Sequence) and not isinstance(devices, str):
            devices = tuple(devices)
        return cls(accelerator=str(trainer.get("accelerator", "auto")), devices=devices,
                   num_nodes=int(trainer.get("num_nodes", 1)),
                   strategy=trainer.get("strategy", "auto"))


@dataclass(frozen=True)
class BatchSettings:
    global_batch_size: int  # records per optimizer step, over all ranks
    micro_batch_size: Any  # records per forward on one rank, or auto (crm.training.resolve.batch_plan)
    max_micro_batch_size: int  # auto's bound (the memory's)


@dataclass(frozen=True)
class StartSettings:
    """What a run decides its automatic choices from (crm.training.resolve.resolve): crm-train's
    settings (crm.cli.train.TrainConfig.start_settings), or those crm-plan states for the run it
    plans (crm.cli.plan.planned_run)."""

    devices: DeviceSettings
    batch: BatchSettings
    model: ModelConfig
    loss: LossConfig
    lora: LoraConfig
    parallel: ParallelConfig
    compile: Any  # auto, true or false
    packing: Any  # stream.packing: auto, true or false
    max_tokens: int  # stream.max_tokens: one row's length
    transform: TransformSettings  # its ties keep or drop, decided with the settings (tie_policy)
