"""The LightningModule: a CRM (crm.models), its loss, metrics and optimizer."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup


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

    The CRM is built in `configure_model` from `build_crm`, so a sharding strategy can build it
    on the meta device and shard it before its weights exist.
    """

    def __init__(self, build_crm: Callable[[], torch.nn.Module], optim: OptimConfig):
        super().__init__()
        self.build_crm, self.optim = build_crm, optim
        self.crm: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.crm is None:
            self.crm = self.build_crm()

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        out = self.crm.loss(batch)
        n = int(out["n"])
        if n:
            train = stage == "train"
            for name, value in out.items():
                if name != "n":
                    self.log(f"{stage}/{name}", value, batch_size=n, sync_dist=not train,
                             prog_bar=name in ("loss", "acc"), on_step=train, on_epoch=not train)
        if stage == "train":
            # What the length policy did, summed over the run (a healthy run keeps both near 0).
            self.log_dict({"data/shortened": batch["shortened"].float(),
                           "data/dropped": batch["dropped"].float()},
                          reduce_fx="sum", on_step=False, on_epoch=True)
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
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        total = self.trainer.estimated_stepping_batches
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=min(o.warmup_steps, total), num_training_steps=total,
            min_lr_rate=o.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
