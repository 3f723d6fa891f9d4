"""The preemption callback saves at step boundaries only (after an optimizer step, never between
the micro batches of an accumulation), read from the Trainer's public global_step.
tests/training/test_distributed.py signals real runs, with accumulation and over 2 nodes."""
from __future__ import annotations

import signal
from types import SimpleNamespace

from crm.training.preemption import Preemption


class FakeTrainer(SimpleNamespace):
    def save_checkpoint(self, path):
        self.saved.append((path, self.global_step))


def test_the_save_waits_for_the_next_optimizer_step(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    trainer = FakeTrainer(global_step=5, world_size=1, is_global_zero=True, should_stop=False,
                          saved=[])  # resumed at step 5, accumulation 2
    callback = Preemption(str(tmp_path / "last.ckpt"), signum=signal.SIGUSR1)
    callback.on_train_start(trainer, None)
    callback._on_signal(signal.SIGUSR1, None)
    callback.on_train_batch_end(trainer, None, None, None, 0)  # first micro batch of step 6
    assert trainer.saved == [] and not callback.preempted
    trainer.global_step = 6  # the second one stepped the optimizer
    callback.on_train_batch_end(trainer, None, None, None, 1)
    assert trainer.saved == [(str(tmp_path / "last.ckpt"), 6)]
    assert callback.preempted and trainer.should_stop
