"""The training progress bar: Lightning's, counting what a step-bound run does.

crm-train runs by optimizer steps (`max_epochs: -1`, `trainer.max_steps`) with accumulation.
Lightning's bars then show "Epoch 6/-2" (max_epochs - 1) and size the last epoch's bar by the
optimizer steps left, read as batches (a bar of 4 where 6 micro batches run, or the reverse).
These count micro batches: the steps left times the accumulation, at most the epoch's batches.
"""
from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE


class _StepBound:
    @property
    def total_train_batches(self):
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps and trainer.max_steps > 0:
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            return min(trainer.num_training_batches, left)
        return trainer.num_training_batches


class StepRichBar(_StepBound, RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        if self.trainer.max_epochs not in (None, -1):  # -1: no epoch bound, nothing to show
            description += f"/{self.trainer.max_epochs - 1}"
        return f"{description:{len(self.validation_description)}}"


class StepTQDMBar(_StepBound, TQDMProgressBar):
    pass


def progress_bar(refresh_rate: int | None = None):
    """The bar Lightning would choose (Rich where installed), step-bound; `refresh_rate` (TQDM's)
    where each refresh must be rare (a CUDA run: the bar reads the logged loss from the GPU)."""
    if refresh_rate is None and _RICH_AVAILABLE:
        return StepRichBar()
    return StepTQDMBar(refresh_rate=refresh_rate or 1)
