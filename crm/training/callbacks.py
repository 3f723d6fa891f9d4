"""Callbacks of a crm-train run: the card in every checkpoint, the export of the best model at the
end, and the per-rank memory report."""
from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch

from crm.models.checkpoint import CARD, build_from_card, describe, export_checkpoint, tie_record
from crm.models.export import export_crm
from crm.models.lora import merged_weights

log = logging.getLogger(__name__)


class CheckpointCard(L.Callback):
    """Puts the CRM's card (crm.models.checkpoint.describe: tokenizer files, HF config, template, kind)
    into every checkpoint, so that a checkpoint alone exports and scores."""

    def __init__(self, tokenizer, *, kind: str, template, max_tokens: int):
        self.tokenizer, self.kind, self.template, self.max_tokens = tokenizer, kind, template, max_tokens
        self._card: dict | None = None

    def card(self, pl_module) -> dict:
        if self._card is None:
            self._card = describe(pl_module.crm.model, self.tokenizer, kind=self.kind,
                                  template=self.template, max_tokens=self.max_tokens)
        return self._card

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[CARD] = self.card(pl_module)


class ModelSize(L.Callback):
    """One line at the start of fit (global rank 0): the CRM's parameters, how many train, and
    their bytes, in place of Lightning's summary table (crm.training.trainer.make_trainer)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        from lightning.pytorch.utilities.model_summary import get_human_readable_count

        params = list(pl_module.parameters())  # a DTensor counts its global size
        total = sum(p.numel() for p in params)
        trained = sum(p.numel() for p in params if p.requires_grad)
        size = sum(p.numel() * p.element_size() for p in params)
        log.info("%s: %s parameters, %s trained, %.1f MB", type(pl_module.crm).__name__,
                 get_human_readable_count(total), get_human_readable_count(trained), size / 1e6)


class ExportBest(L.Callback):
    """The best checkpoint's model (or the final one) written to `out_dir`, by rank 0 after every
    rank has left the process group (`export`): reading a sharded checkpoint and writing the HF
    directory takes minutes on a large model, and ranks waiting in a collective meanwhile would
    outlast the process-group timeout (docs/DESIGN.md section 9). Inside fit, at its end, every
    rank only takes part in gathering the final weights when no validation checkpoint exists."""

    def __init__(self, out_dir: str | Path, card: CheckpointCard, preemption=None):
        self.out_dir, self.card, self.preemption = Path(out_dir), card, preemption
        self._final: dict | None = None  # rank 0: the gathered final weights (no best checkpoint)
        self._ties: dict | None = None  # and the tie model of a Davidson pointwise CRM

    def _skipped(self) -> bool:
        return self.preemption is not None and self.preemption.preempted  # the requeued job exports

    def on_fit_end(self, trainer: L.Trainer, pl_module) -> None:
        if self._skipped() or _best_path(trainer):
            return
        final = full_model_state(pl_module)  # a collective: every rank, from any sharding
        ties = full_tie_record(pl_module)  # a collective too, under FSDP
        if trainer.is_global_zero:
            self._final, self._ties = final, ties

    def export(self, trainer: L.Trainer, pl_module) -> None:
        """Rank 0, after fit and after leaving the process group: no collective here."""
        if self._skipped():
            return
        best = _best_path(trainer)
        log.info("exporting %s to %s", best or "the final weights (no validation checkpoint)",
                 self.out_dir)
        if best:
            export_checkpoint(best, self.out_dir)
            return
        final, self._final = self._final, None
        extra = {"source": "final weights (no validation checkpoint)",
                 "global_step": trainer.global_step, "config": pl_module.run_config}
        if pl_module.lora:  # the adapters merged into the base, as crm-export does
            final = merged_weights(final, pl_module.lora)
            extra["lora"] = {**pl_module.lora, "form": "merged"}
        crm = build_from_card(self.card.card(pl_module), final)
        export_crm(crm.model, crm.tokenizer, self.out_dir, kind=crm.kind, template=crm.template,
                   max_tokens=crm.max_tokens, extra=extra, ties=self._ties)


def _best_path(trainer: L.Trainer) -> str:
    return trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""


def full_model_state(pl_module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(pl_module.crm.model,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_tie_record(pl_module) -> dict | None:
    log_nu = getattr(pl_module.crm, "tie_log_nu", None)
    if log_nu is not None and hasattr(log_nu, "full_tensor"):  # an FSDP2 shard: gathered
        log_nu = log_nu.full_tensor()
    return tie_record(None if log_nu is None else log_nu.detach().cpu())


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
        from torch.distributed.fsdp import FSDPModule

        # FSDP2 keeps the root gathered after a forward (the last validation's, here): count the
        # parameters as they are stored, sharded.
        for module in pl_module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        params = local_bytes(pl_module.parameters())
        optim = sum(local_bytes(state.values()) for opt in trainer.optimizers
                    for state in opt.state.values())
        gathered = trainer.strategy.all_gather(torch.tensor([params, optim], dtype=torch.float64,
                                                            device=pl_module.device))
        rows = gathered.reshape(-1, 2).tolist()
        self.per_rank = [{"rank": i, "param_bytes": int(p), "optimizer_bytes": int(o)}
                         for i, (p, o) in enumerate(rows)]
