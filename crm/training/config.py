"""The training layer's settings as a user writes them: crm-train's `optim`, `parallel` and
`logger` sections (configs/train.yaml, configs/parallel, configs/logger), read by crm.training.module,
crm.training.parallel and crm.training.loggers.

Plain Python, no torch or Lightning: a command composes and checks its config before loading them
(crm.models.config says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


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
