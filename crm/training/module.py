"""The LightningModule: a CRM (crm.models), its loss, metrics and optimizer."""
from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from crm.core.errors import ConfigError
from crm.models.checkpoint import LORA
from crm.models.heads import TIE_LR_SCALE, TIE_PARAMETER
from crm.models.packing import use_packed_attention
from crm.training.config import OptimConfig
from crm.training.parallel import (ParallelConfig, all_ranks_sum, build_sharded, data_parallel_mesh,
                                   prepare_layers)


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
                 compile: bool = False, lora: dict | None = None):
        super().__init__()
        self.build_crm, self.optim = build_crm, optim
        self.parallel = parallel or ParallelConfig()
        self.run_config = run_config or {}
        self.compile = compile
        # A LoRA run: what its checkpoints say of their base (crm.models.lora.base_record). A base
        # read from a checkpoint dir stays out of them (adapters, head and optimizer only), so
        # resuming loads a partial state dict: `strict_loading` off, and on_load_checkpoint checks
        # the base and the trained names itself.
        self.lora = lora
        self.saves_frozen = not (lora and lora["base"])
        self.strict_loading = self.saves_frozen
        self.crm: torch.nn.Module | None = None
        # Running sums (the CRM's metrics, then the example count) between their reductions.
        self._train_sums: torch.Tensor | None = None
        self._val_sums: torch.Tensor | None = None
        self._data_counts = [0, 0]  # this rank's shortened and dropped examples of the epoch

    def configure_model(self) -> None:
        if self.crm is not None:
            return
        if self.device_mesh is not None:  # ModelParallelStrategy: FSDP2 over the data-parallel ranks
            mesh = data_parallel_mesh(self.device_mesh["data_parallel"], self.parallel.sharding,
                                      self.trainer.num_nodes)
            self.crm = build_sharded(self.build_crm, mesh, self.parallel, self.compile)
        else:
            self.crm = self.build_crm()
            prepare_layers(self.crm, self.parallel, self.compile)
        if self.crm.model.config._attn_implementation == "sdpa":
            # transformers' sdpa path, given a right-padded batch without a mask, first asks
            # whether the positions describe packed sequences (masking_utils'
            # find_packed_sequence_indices: `.all()` of a device tensor), a host sync at every
            # forward on a GPU. crm's attention function is outside transformers' mask registry,
            # so that question is not asked, and a plain (unpacked) call still runs sdpa's causal
            # kernel with no mask (crm.models.packing.packed_attention).
            use_packed_attention(self.crm.model)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["crm_config"] = self.run_config
        if self.lora is None:
            return
        checkpoint[LORA] = self.lora
        if not self.saves_frozen:
            frozen = self.frozen_names()
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                        if k not in frozen}

    def frozen_names(self) -> set[str]:
        return {f"crm.{name}" for name, p in self.crm.named_parameters() if not p.requires_grad}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.check_resume(checkpoint)

    def check_resume(self, checkpoint: dict) -> None:
        """Refuses, in one line, a checkpoint of another kind of run (LoRA vs full, other
        adapters) or one whose LoRA base is not this run's base. A sharded checkpoint is checked
        before its weights are read (FSDPStrategy.load_checkpoint), a file before they load."""
        stored = checkpoint.get(LORA)
        if (stored is None) != (self.lora is None):
            kinds = ("a LoRA", "a full-model") if stored else ("a full-model", "a LoRA")
            raise ConfigError(f"resume: the checkpoint is {kinds[0]} run's, this run is {kinds[1]} "
                              "run (lora.rank); resume with the same setting or resume=false")
        if stored is None:
            return
        if stored["config"] != self.lora["config"]:
            raise ConfigError(f"resume: the checkpoint's LoRA settings {stored['config']} differ "
                              f"from this run's {self.lora['config']}")
        if stored["fingerprint"] != self.lora["fingerprint"]:  # a moved base is the same base
            raise ConfigError(f"resume: the checkpoint's LoRA adapters trained on the base "
                              f"{stored['base']} (fingerprint {stored['fingerprint']}), this run's "
                              f"base is {self.lora['base']} ({self.lora['fingerprint']}): a changed "
                              "base would make the adapters meaningless")
        if not self.saves_frozen and "state_dict" in checkpoint:  # a single file: checked here
            wanted = set(self.state_dict()) - self.frozen_names()
            missing = sorted(wanted - set(checkpoint["state_dict"]))
            if missing:
                raise ConfigError(f"resume: {len(missing)} trained weights missing from the "
                                  f"checkpoint, e.g. {missing[0]}")

    # -- the loss: the sum over a step's examples / their global count --------------------------

    def _sums(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the batch's summed loss, to backpropagate; its loss and metric sums and example count
        as one detached vector in the CRM's `metrics` order, then n: what the ranks reduce)."""
        sums = self.crm.loss_sums(batch)
        values = [sums[name].detach().float() for name in self.crm.metrics]
        # torch.full launches a fill: no host-to-device copy for the host to wait on.
        n = torch.full((), float(sums["n"]), device=values[0].device)
        return sums["loss"], torch.stack([*values, n])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """The micro batch's share of the step's loss: the sum of its examples' losses over the
        count of the step's examples on every rank and micro batch (`batch["step_examples"]`,
        summed over ranks once, at the step's first micro batch, by every rank whatever its batch
        holds). Times the data-parallel world (DDP and FSDP average gradients over it) and the
        accumulation (Lightning divides by it), every example weighs the same wherever it lands,
        and an emptied micro batch is a zero, not a hang (docs/DESIGN.md section 9)."""
        if batch_idx != batch["epoch_index"]:
            # Lightning groups micro batches into steps by its count of the epoch, the stream by
            # its position: they part only when Lightning's restored loop disagrees with the
            # stream's epoch (a resume at another world size whose epochs differ in length).
            raise RuntimeError(
                f"the training stream is at micro batch {batch['epoch_index']} of its epoch, "
                f"Lightning's loop at {batch_idx}: resume at another world size from a checkpoint "
                "of an epoch end with the same micro batches a rank per epoch, or at the same "
                "world size (docs/CHECKPOINTING.md)")
        if batch["step_index"] == 0:
            self._step_examples = all_ranks_sum(batch["step_examples"].to(self.device).float())
        loss_sum, sums = self._sums(batch)
        self._train_sums = sums if self._train_sums is None else self._train_sums + sums
        if batch["step_index"] == batch["step_batches"] - 1 and self._logging_step():
            self._log_sums("train", all_ranks_sum(self._train_sums))
            self._train_sums = None
        # What the length policy did, counted on the host (the stream's plain ints) and logged
        # once an epoch (on_train_epoch_end), not through Lightning's `log` at every micro batch,
        # the costliest of the step's own host work (docs/PERFORMANCE.md section 13).
        self._data_counts[0] += int(batch["shortened"])
        self._data_counts[1] += int(batch["dropped"])
        scale = self.trainer.world_size * self.trainer.accumulate_grad_batches
        return loss_sum * scale / self._step_examples.clamp(min=1.0)

    def on_train_epoch_end(self) -> None:
        # Summed over the epoch and the ranks (healthy runs keep both ~0); every rank logs both,
        # so the reduction is the same collective on each.
        shortened, dropped = self._data_counts
        self._data_counts = [0, 0]
        self.log_dict({"data/shortened": torch.tensor(float(shortened), device=self.device),
                       "data/dropped": torch.tensor(float(dropped), device=self.device)},
                      reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        _, sums = self._sums(batch)
        self._val_sums = sums if self._val_sums is None else self._val_sums + sums

    def on_validation_epoch_start(self) -> None:
        self._val_sums = None

    def on_validation_epoch_end(self) -> None:
        # Every rank has the same number of val batches (the epoch plan), but not necessarily
        # any examples: one reduction here, whatever the batches held.
        sums = self._val_sums
        if sums is None:  # no val batch on this rank (limit_val_batches=0): zeros of the same size
            sums = torch.zeros(len(self.crm.metrics) + 1, device=self.device)
        self._log_sums("val", all_ranks_sum(sums))

    def _log_sums(self, stage: str, sums: torch.Tensor) -> None:
        """Logs each metric's mean over the reduced examples; every rank holds the same values."""
        *values, n = sums
        train = stage == "train"
        # Lightning converts the bar's values to numbers at the end of every micro batch, logging
        # or not (even with no bar shown): on a GPU, a host sync each time. There the bar shows
        # no loss (the logger has it); on the CPU a number costs nothing.
        bar = self.trainer.progress_bar_callback is not None and self.device.type == "cpu"
        for name, value in zip(self.crm.metrics, values, strict=True):
            self.log(f"{stage}/{name}", value / n.clamp(min=1.0),
                     prog_bar=bar and name in ("loss", "acc"), on_step=train, on_epoch=not train,
                     sync_dist=False)

    def _logging_step(self) -> bool:
        # global_step counts the optimizer steps taken, this one not yet: the same on every rank.
        every = self.trainer.log_every_n_steps
        return bool(every) and (self.trainer.global_step + 1) % every == 0

    def configure_optimizers(self):
        decay, no_decay, tie = [], [], []
        for name, p in self.crm.named_parameters():
            if p.requires_grad:
                (tie if name == TIE_PARAMETER else decay if p.ndim >= 2 else no_decay).append(p)
        o = self.optim
        # One fused kernel for the whole update on CUDA instead of a few per parameter group;
        # elsewhere torch's default (foreach), which the CPU figures were measured with.
        fused = True if decay and decay[0].device.type == "cuda" else None
        groups = [{"params": decay, "weight_decay": o.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        if tie:
            groups.append({"params": tie, "weight_decay": 0.0, "lr": o.lr * TIE_LR_SCALE})
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused)
        total = self.trainer.estimated_stepping_batches
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=min(o.warmup_steps, total), num_training_steps=total,
            min_lr_rate=o.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
