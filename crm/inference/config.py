"""The inference layer's settings: the scoring engine (the `engine` group of crm-eval,
crm-leaderboard and crm-usl, configs/engine/<name>.yaml, read by crm.inference.engine) and the RL
reward's strategies (crm.inference.reward).

Plain Python, no torch: a command composes and checks its config before loading torch
(crm.models.config says why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENGINES = ("local", "ray")
# How a CRMReward (crm.inference.reward) turns a CRM's verdicts into rewards.
STRATEGIES = ("pointwise", "reference", "round_robin")


@dataclass(frozen=True)
class EngineConfig:
    """configs/engine/<name>.yaml: where the scoring of crm-eval, crm-leaderboard and crm-usl runs."""

    name: str = "local"  # local | ray
    address: str | None = None  # null: start a local Ray; auto or host:port: join a running cluster
    workers: int | None = None  # null: one per GPU of the cluster (one per cpus_per_worker cores without)
    gpus_per_worker: float | None = None  # null: 1 where the cluster has GPUs, else 0
    cpus_per_worker: int = 1  # CPU cores (and torch threads on CPU) per worker
    block_prompts: int = 64  # prompt groups per block at most (fewer where a worker would get < 2 blocks)
    block_attempts: int = 3  # a block that fails this many times (death, timeout, bad reply) stops the job
    # seconds a block may run before its worker is replaced and the block redone elsewhere; auto:
    # from the block's size and the session's measured rate, with a floor (crm.inference.engine)
    block_timeout: Any = "auto"  # Any: "auto" or a number of seconds
    connect_timeout: float = 30.0  # seconds to reach engine.address
    object_store_mib: int = 256  # a local Ray's object store (blocks are small)

    def __post_init__(self):
        if self.name not in ENGINES:
            raise ValueError(f"engine={self.name}: expected one of {', '.join(ENGINES)}")
        for key in ("workers", "cpus_per_worker", "block_prompts", "block_attempts"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"engine.{key}={value}: expected a whole number >= 1")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"engine.gpus_per_worker={self.gpus_per_worker}: expected >= 0")
        if self.block_timeout != "auto" and (isinstance(self.block_timeout, (bool, str))
                                             or not self.block_timeout > 0):
            raise ValueError(f"engine.block_timeout={self.block_timeout}: expected auto or a "
                             "number of seconds > 0")
        if self.connect_timeout <= 0:
            raise ValueError(f"engine.connect_timeout={self.connect_timeout}: expected > 0")
        if self.object_store_mib < 80:  # Ray refuses less than 75 MiB
            raise ValueError(f"engine.object_store_mib={self.object_store_mib}: at least 80")
