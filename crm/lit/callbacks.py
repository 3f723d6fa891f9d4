"""Callbacks: export of the best model as a HF directory."""
from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch

from crm.models.export import export_crm

log = logging.getLogger(__name__)
PREFIX = "crm.model."


def load_checkpoint_file(path: str | Path) -> dict:
    """A Lightning checkpoint as one dict: a single file, or a sharded (FSDP) dir consolidated.

    Tensors only (weights_only=True); a sharded dir's weights are read with torch's distributed
    checkpoint reader, without a process group, and its metadata from Lightning's meta.pt.
    """
    path = Path(path)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # What torch's dcp_to_torch_save does, for the weights only and in memory: no_dist lets one
    # rank read every shard while the others wait.
    weights: dict = {}
    _load_state_dict(weights, storage_reader=FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}), no_dist=True)
    checkpoint = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = weights["state_dict"]
    return checkpoint


def model_state_from_checkpoint(path: str | Path) -> tuple[dict, int]:
    """(the HF model's weights, the step) from a Lightning checkpoint, file or sharded dir."""
    checkpoint = load_checkpoint_file(path)
    state = checkpoint["state_dict"]
    return {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}, checkpoint["global_step"]


class ExportBest(L.Callback):
    """At the end of fit, writes the best checkpoint's model (or the final one) to `out_dir`."""

    def __init__(self, out_dir: str | Path, tokenizer, *, kind: str, template, max_tokens: int,
                 extra: dict | None = None, preemption=None):
        self.out_dir, self.tokenizer, self.kind = Path(out_dir), tokenizer, kind
        self.template, self.max_tokens, self.extra = template, max_tokens, extra or {}
        self.preemption = preemption

    def on_fit_end(self, trainer: L.Trainer, pl_module) -> None:
        if self.preemption is not None and self.preemption.preempted:
            return  # the requeued job finishes the run and exports then
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        if best:
            trainer.strategy.barrier()  # every rank's shards of the best checkpoint are on disk
        else:  # no validation ran: the final weights, gathered by every rank from any sharding
            final = full_model_state(pl_module)
        if not trainer.is_global_zero:
            return
        state, step = model_state_from_checkpoint(best) if best else (final, trainer.global_step)
        # A fresh unsharded model receives the weights: the trained one may be FSDP-sharded.
        model = pl_module.build_crm().model
        model.load_state_dict(state)
        source = best or "final weights (no validation checkpoint)"
        log.info("exporting %s to %s", source, self.out_dir)
        export_crm(model, self.tokenizer, self.out_dir, kind=self.kind, template=self.template,
                   max_tokens=self.max_tokens,
                   extra={"source": str(source), "global_step": step, **self.extra})


def full_model_state(pl_module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(pl_module.crm.model,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors` (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


class ShardingReport(L.Callback):
    """Per-rank bytes of parameters and optimizer states after training, gathered on every rank.

    The measured side of memory planning: under FSDP each rank should hold about 1/world of both.
    """

    def __init__(self):
        self.per_rank: list[dict] = []

    def on_train_end(self, trainer, pl_module) -> None:
        params = local_bytes(pl_module.parameters())
        optim = sum(local_bytes(state.values()) for opt in trainer.optimizers
                    for state in opt.state.values())
        gathered = trainer.strategy.all_gather(torch.tensor([params, optim], dtype=torch.float64,
                                                            device=pl_module.device))
        rows = gathered.reshape(-1, 2).tolist()
        self.per_rank = [{"rank": i, "param_bytes": int(p), "optimizer_bytes": int(o)}
                         for i, (p, o) in enumerate(rows)]
