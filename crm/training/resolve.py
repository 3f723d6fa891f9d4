"""What a crm-train run's automatic settings became at start, as one record.

`compile`, `stream.packing`, `micro_batch_size`, `parallel.sharding` and `parallel.timeout_minutes`
may say `auto`; the run decides each once at start (crm.cli.train) and this record holds what
ran. It is kept whole in the run config (every checkpoint's `crm_config`, the export's crm.json,
the logger's hyperparameters) and in metrics.json, so that a run is read back as it ran, never as
`auto` (docs/DESIGN.md section 9).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


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
