"""The LightningModule: a CRM (crm.models), its loss, metrics and optimizer."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from crm.training.parallel import ParallelConfig, build_sharded, prepare_layers


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3  # peak learning rate, reached after warmup
    weight_decay: float = 0.01  # AdamW decay on matrices; norms and biases are not decayed
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100  # linear warmup, then cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.0


class CRMModule(L.LightningModule):
    """Trains a PairwiseCRM (L_cls) or a PointwiseCRM (L_ranking).

    The CRM is built in `configure_model` from `build_crm`, after the strategy has set up the
    process group: under FSDP (ModelParallelStrategy) it is sharded there, before the optimizer
    exists, and pretrained weights are read into the shards (crm.training.parallel.build_sharded), so
    `build_crm` takes an optional `device` ("meta": shapes only, nothing read). Each decoder layer
    is compiled there too with `compile` (crm.models.compile). `run_config`
    (plain data) is stored in every checkpoint, so a checkpoint says what it holds.
    """

    def __init__(self, build_crm: Callable[[], torch.nn.Module], optim: OptimConfig,
                 parallel: ParallelConfig | None = None, run_config: dict | None = None,
                 compile: bool = False):
        super().__init__()
        self.build_crm, self.optim = build_crm, optim
        self.parallel = parallel or ParallelConfig()
        self.run_config = run_config or {}
        self.compile = compile
        self.crm: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.crm is not None:
            return
        if self.device_mesh is not None:  # ModelParallelStrategy: FSDP2 over the data-parallel ranks
            mesh = self.device_mesh["data_parallel"]
            self.crm = build_sharded(self.build_crm, mesh, self.parallel, self.compile)
        else:
            self.crm = self.build_crm()
            prepare_layers(self.crm, self.parallel, self.compile)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["crm_config"] = self.run_config

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        out = self.crm.loss(batch)
        n = int(out["n"])
        if n:
            train = stage == "train"
            for name, value in out.items():
                if name != "n":
                    # train/loss is the global batch's (averaged over ranks), comparable across
                    # world sizes; one scalar all-reduce per step is cheap next to the step.
                    self.log(f"{stage}/{name}", value, batch_size=n,
                             sync_dist=not train or name == "loss",
                             prog_bar=name in ("loss", "acc"), on_step=train, on_epoch=not train)
        if stage == "train":
            # What the length policy did, summed over the run and ranks (healthy runs keep both ~0).
            self.log_dict({"data/shortened": batch["shortened"].float(),
                           "data/dropped": batch["dropped"].float()},
                          reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)
        return out["loss"]

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self):
        decay, no_decay = [], []
        for p in self.crm.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        o = self.optim
        # One fused kernel for the whole update on CUDA instead of a few per parameter group;
        # elsewhere torch's default (foreach), which the CPU figures were measured with.
        fused = True if decay and decay[0].device.type == "cuda" else None
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused)
        total = self.trainer.estimated_stepping_batches
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=min(o.warmup_steps, total), num_training_steps=total,
            min_lr_rate=o.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
