"""Callbacks: export of the best model as a HF directory."""
from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch

from crm.models.export import export_crm

log = logging.getLogger(__name__)
PREFIX = "crm.model."


def model_state_from_checkpoint(path: str | Path) -> tuple[dict, int]:
    """(the HF model's weights, the step) from a Lightning checkpoint (weights_only=True)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    return {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}, checkpoint["global_step"]


class ExportBest(L.Callback):
    """At the end of fit, writes the best checkpoint's model (or the final one) to `out_dir`."""

    def __init__(self, out_dir: str | Path, tokenizer, *, kind: str, template, max_tokens: int,
                 extra: dict | None = None):
        self.out_dir, self.tokenizer, self.kind = Path(out_dir), tokenizer, kind
        self.template, self.max_tokens, self.extra = template, max_tokens, extra or {}

    def on_fit_end(self, trainer: L.Trainer, pl_module) -> None:
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        if not trainer.is_global_zero:
            return
        state, step = model_state_from_checkpoint(best) if best else (None, trainer.global_step)
        source = best or "final weights (no validation checkpoint)"
        log.info("exporting %s to %s", source, self.out_dir)
        export_crm(pl_module.crm.model, self.tokenizer, self.out_dir, kind=self.kind,
                   template=self.template, max_tokens=self.max_tokens, state_dict=state,
                   extra={"source": str(source), "global_step": step, **self.extra})
