"""The training stream's settings: `StreamSettings` (what a user sets: crm-train's `stream` section)
and `StreamConfig` (with what the run decides), read by crm.data.stream.

Plain Python, no torch: a command composes and checks its config before loading torch
(crm.models.config says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from crm.core.prompts import PromptTemplate

MODES = ("pairwise", "pointwise")


def check_packing(setting) -> None:
    """`stream.packing` is auto, true or false: 0, 1 and 1.0 equal false and true in Python, and
    are refused as the other wrong values are (`resolve_packing` resolves auto)."""
    if not (setting is True or setting is False or setting == "auto"):
        raise ValueError(f"stream.packing={setting!r}: expected auto, true or false")


def resolve_packing(setting, device_type: str, mode: str) -> bool:
    """`stream.packing` for a `mode` run on `device_type`: auto = where it was measured faster
    (docs/PERFORMANCE.md section 5): on CUDA, pairwise and pointwise. On CPU rows stay padded: at
    the demo's sizes with torch's two threads the gathered views cost what the shared prefix and
    the padding save (docs/PERFORMANCE.md section 5 has the figures). `mode` is
    part of the question, as the measurements were per mode. Here, beside the setting, and not
    with the packed kernels (crm.models.packing): a plan or a refusal needs no transformers."""
    check_packing(setting)
    return device_type == "cuda" if setting == "auto" else setting


@dataclass(frozen=True)
class StreamSettings:
    """What a user sets: crm-train's `stream` section (configs/train.yaml) is this dataclass."""

    max_tokens: int = 1024  # length policy limit of one row
    min_turn_tokens: int = 16  # the least a shortened message keeps
    shuffle_buffer: int = 2048  # records mixed across shard boundaries
    window_batches: int = 32  # length grouping: sort this many batches' worth of records by length
    num_workers: int = 0  # DataLoader workers per rank; 0 encodes in the training process
    packing: Any = "auto"  # auto | true | false: a batch is one row of its records' real tokens
    # (crm.data.packing); auto is resolved for the run's device by resolve_packing
    token_budget: int | None = None  # packed rows padded to this many tokens (crm.data.packing.Budget)

    def __post_init__(self):
        check_packing(self.packing)  # at composition: before torch loads
        budget = self.token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"stream.token_budget={budget!r}: expected a number of tokens >= 1, or null")


@dataclass(frozen=True, kw_only=True)
class StreamConfig(StreamSettings):
    """The settings and what the run decides: the micro batch, the loss's rows, the seed, the
    prompt template."""

    batch_size: int  # records per batch on one rank (the micro batch)
    # resolved: the run's choice. A library user's default is padded rows, what crm-train's auto
    # chooses on CPU and what every device runs; packed rows pay off on CUDA (PERFORMANCE.md 5).
    packing: bool = False
    # packed rows: also the views the CPU's gather kernel reads (crm.models.packing.attention_path);
    # CUDA's kernels read only the ids and the segment starts
    gather_views: bool = True
    mode: str = "pairwise"  # pointwise: each record gives a chosen and a rejected row, in one batch
    seed: int = 0
    shuffle: bool = True  # False for validation: a fixed order, epoch 0's draws
    template: PromptTemplate = field(default_factory=PromptTemplate)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.packing, bool):
            raise ValueError(f"stream packing={self.packing!r}: a StreamConfig takes true or false "
                             "(resolve_packing resolves auto for a device)")
        if self.mode not in MODES:
            raise ValueError(f"stream mode={self.mode!r}: expected one of {MODES}")
