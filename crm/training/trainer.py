"""The Lightning Trainer of a run: world size, gradient accumulation, strategy.

The trainer group holds Trainer arguments as they are, except `strategy: fsdp`, which is crm's
FSDP2 (crm.training.parallel).
"""
from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy

from crm.core.errors import ConfigError
from crm.training.parallel import ParallelConfig, fsdp_strategy
from crm.training.resume import resolve_resume

log = logging.getLogger(__name__)


def make_trainer(trainer: dict, *, world: int, accumulation: int, val_every_n_steps: int,
                 callbacks: list, logger, run_dir: Path,
                 parallel: ParallelConfig | None = None) -> L.Trainer:
    """A Trainer from the trainer group, over the `world` processes the run laid out
    (crm.training.resolve.lay_out); validation every `val_every_n_steps` optimizer steps; the
    process group's timeout `parallel.timeout_minutes` (fsdp and ddp).

    On SLURM, Lightning's own auto-requeue is switched off: crm.training.preemption owns the signal.
    """
    quiet_known_warnings()
    kwargs = dict(trainer)
    # Lightning's summary table has a FLOPs column that reads 0 without an example input; crm's
    # ModelSize callback logs the parameters in one line instead (crm's FLOPs are perf/*).
    kwargs.setdefault("enable_model_summary", False)
    if kwargs.get("strategy") == "fsdp":
        kwargs["strategy"] = fsdp_strategy(world, parallel)
    elif kwargs.get("strategy") == "ddp" and parallel is not None and parallel.timeout is not None:
        kwargs["strategy"] = DDPStrategy(timeout=parallel.timeout)
    if SLURMEnvironment.detect():
        kwargs["plugins"] = [SLURMEnvironment(auto_requeue=False)]
    built = L.Trainer(**kwargs, accumulate_grad_batches=accumulation, callbacks=callbacks,
                      logger=logger, val_check_interval=val_every_n_steps * accumulation,
                      check_val_every_n_epoch=None, default_root_dir=str(run_dir))
    validate_on_step_boundaries(built, val_every_n_steps)
    return built


def quiet_known_warnings() -> None:
    """Warnings every run printed that no user can act on, each known to be harmless here."""
    # Lightning 2.6 flattens batches with torch's LeafSpec, which torch 2.13 deprecates: Lightning's
    # to change; the result is the same.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # Lightning warns that an IterableDataset's length may be wrong when each worker does not take
    # its own part: crm's stream cuts a rank's records into chunks and gives each worker its own
    # (crm.data.stream), so the length, the rank's batch count, is exact for any worker count.
    warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")


def validate_on_step_boundaries(trainer: L.Trainer, every_n_steps: int) -> None:
    """Validation (and so best.ckpt) after every `every_n_steps`-th optimizer step, in every epoch.

    Lightning's `val_check_interval` counts micro batches over the run. An epoch whose micro
    batches are not a multiple of the accumulation ends with a shorter step (Lightning steps on
    an epoch's last batch), and from the next epoch on that count falls mid-step: a validation
    between micro batches, and a best.ckpt that cannot resume (the step's example count is
    summed at its first micro batch). Lightning (2.6) asks its epoch loop's `_should_check_val_fx`
    after each batch; here it answers from the optimizer steps. As Lightning's, it validates
    before a stop requested in training (not a preemption's: that one sets no validation).
    """
    loop = trainer.fit_loop.epoch_loop

    def should_validate(data_fetcher) -> bool:
        if not loop._should_check_val_epoch() or loop._should_accumulate():
            return False
        if trainer.should_stop and trainer.fit_loop._can_stop_early:
            return True
        return trainer.global_step % every_n_steps == 0

    loop._should_check_val_fx = should_validate


def leave_process_group(trainer: L.Trainer) -> None:
    """Every rank leaves the process group together once training is over.

    Lightning destroys the group at exit under NCCL only. A gloo group (CPU runs, and the
    preemption flags' group on every run) left to interpreter shutdown can abort a finished
    process, its worker threads outliving the interpreter ("terminate called without an active
    exception", exit -6), and a scheduler counts that job as failed. The barrier first: no rank
    closes its connections while another still uses them.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        trainer.strategy.barrier("leave_process_group")
        torch.distributed.destroy_process_group()
        log.info("left the process group")  # rank 0's export and evaluation come after this line

class AgreedResume(os.PathLike):
    """fit's `ckpt_path` when every rank must resume from the same checkpoint: rank 0's choice.

    Whether to resume is a decision from the filesystem, which ranks on a shared filesystem may
    see differently (NFS caches), and a job whose ranks disagree hangs. The ranks connect inside
    fit (Lightning launches and connects them there), and Lightning loads the checkpoint only
    after that: its `resume_start` truth-tests the path on every rank at the same point. So the
    decision is made there: rank 0 resolves `resume` (resolve_resume), the strategy broadcasts
    it, and every rank loads what rank 0 chose. Before the ranks connect, Lightning only checks
    that a path was given: it is (undecided). A one-process run needs no agreement: train()
    passes it resolve_resume's answer directly. `on_agreed()` runs on rank 0 once the ranks have
    agreed without a refusal (crm-train writes the run's record then).
    """

    def __init__(self, resume, run_dir: Path, data_path: str | None = None,
                 on_agreed: Callable[[], None] | None = None):
        self.resume, self.run_dir, self.data_path = resume, Path(run_dir), data_path
        self.on_agreed = on_agreed
        self.trainer: L.Trainer | None = None
        self.path: str | None = None
        self.decided = False

    def decide(self) -> str | None:
        if not self.decided:
            strategy = self.trainer.strategy
            choice = error = None
            if strategy.global_rank == 0:
                try:
                    choice = resolve_resume(self.resume, self.run_dir, self.data_path)
                except ConfigError as exc:  # every rank stops with it, none waits for rank 0
                    error = str(exc)
            self.path, error = strategy.broadcast((choice, error))
            self.decided = True
            if error:
                raise ConfigError(error)
            if strategy.global_rank == 0 and self.on_agreed is not None:
                self.on_agreed()
        return self.path

    def __bool__(self) -> bool:
        if not torch.distributed.is_initialized():
            return True
        return self.decide() is not None

    def __fspath__(self) -> str:
        return self.decide()

    def __str__(self) -> str:
        return self.path if self.decided else f"<resume={self.resume} in {self.run_dir}>"

    def __reduce__(self):  # strategies broadcast the path itself: it travels as the decided string
        return str, (self.decide(),)
