"""The preemption callback in process: a signal during optimizer step s saves at the end of step s
(never between the micro batches of an accumulation), then nothing validates or saves again;
SIGTERM feeds the same flag, through a handler that only sets it. tests/training/test_distributed.py
signals real runs, with accumulation and over 2 nodes."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from crm.training import preemption
from crm.training.preemption import Preemption


class FakeTrainer(SimpleNamespace):
    def save_checkpoint(self, path, weights_only=None):
        assert weights_only is False  # the whole state, to resume from
        self.saved.append((path, self.global_step))


@pytest.fixture
def requeues(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(preemption.subprocess, "run",
                        lambda command, check: calls.append(command) or SimpleNamespace(returncode=0))
    return calls


def fake_trainer(tmp_path, global_step: int) -> tuple[FakeTrainer, Preemption, ModelCheckpoint]:
    callback = Preemption(str(tmp_path / "last.ckpt"), signum=signal.SIGUSR1)
    last = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = FakeTrainer(global_step=global_step, world_size=1, is_global_zero=True,
                          should_stop=False, saved=[], limit_val_batches=1.0,
                          callbacks=[callback, last],
                          fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    return trainer, callback, last


def test_a_signal_mid_step_saves_at_the_end_of_that_step_then_nothing_else(tmp_path, monkeypatch,
                                                                          requeues):
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    trainer, callback, _ = fake_trainer(tmp_path, global_step=5)  # resumed at 5, accumulation 2
    previous = signal.getsignal(signal.SIGTERM)
    try:
        callback.on_train_start(trainer, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    callback.on_train_batch_end(trainer, None, None, None, 0)  # first micro batch of step 6
    callback._on_signal(signal.SIGUSR1, None)  # between the micro batches of step 6
    assert trainer.saved == [] and not callback.preempted
    trainer.global_step = 6  # the second one stepped the optimizer
    callback.on_train_batch_end(trainer, None, None, None, 1)
    assert trainer.saved == [(str(tmp_path / "last.ckpt"), 6)]
    assert callback.preempted and trainer.should_stop
    # Lightning validates a run stopped by should_stop (then the best checkpoint may save) and
    # the checkpoint callbacks save at this step or at the end: none of them runs any more.
    assert trainer.limit_val_batches == 0 and trainer.callbacks == [callback]
    assert requeues == [["scontrol", "requeue", "123"]]


def test_sigterm_only_sets_the_flag_and_saves_at_the_boundary_without_a_requeue(tmp_path,
                                                                               monkeypatch,
                                                                               requeues):
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    trainer, callback, _ = fake_trainer(tmp_path, global_step=0)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        callback.on_train_start(trainer, None)
        # Lightning's handler broadcast from inside the handler; its per-batch broadcast of its
        # own flag (and the .item() reading it) is switched off with it.
        assert signal.getsignal(signal.SIGTERM) == callback._on_signal
        assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None
        signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert trainer.saved == [] and not trainer.should_stop  # nothing inside the handler
    trainer.global_step = 1
    callback.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.saved == [(str(tmp_path / "last.ckpt"), 1)] and trainer.should_stop
    assert requeues == []  # SLURM's SIGTERM comes with its own requeue, or with a cancel
