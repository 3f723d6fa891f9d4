"""Preemption: on SLURM's warning signal (or SIGTERM), checkpoint at the end of the optimizer step
in flight, requeue, stop, with nothing run after the save.

One owner of the signals: Lightning's own SLURM auto-requeue is switched off (it saves inside the
signal handler, possibly mid-step, while other ranks may be inside a collective), its SIGTERM
handler is replaced (it broadcasts from inside the handler), and sweeps over the submitit launcher
leave requeueing to this callback too (SLURM.md).
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import threading
from datetime import timedelta

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Checkpoint

log = logging.getLogger(__name__)

# What a rank's flag says, the largest winning across ranks: the warning asks for a requeue.
NONE, TERMINATE, REQUEUE = 0, 1, 2


def slurm_job_id() -> str | None:
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return os.environ.get("SLURM_JOB_ID")


class Preemption(L.Callback):
    """The handlers only set a flag; the save happens where every rank is at the same point (the
    end of an optimizer step), so the checkpoint's weights, optimizer and stream position agree.

    Timeline (SLURM.md, "Preemption and requeue"): with several ranks, a signal that arrives on
    any rank during optimizer step s is in that rank's flag at the end of step s, where every rank
    starts an all-reduce of the flags without waiting for it (a gloo group: CPU tensors, a thread
    of gloo's, no GPU sync, no host barrier on the step); at the end of step s + 1 every rank reads
    that result, the same on all, and saves `checkpoint_path` there, then training stops: no
    validation, no other checkpoint. In one process the flag is read at the end of step s itself.
    The warning signal (`signum`) then has `requeue_command` run on global rank 0, with `{job_id}`
    filled in (skipped with no SLURM job id: a local run just stops with its checkpoint); SIGTERM
    (SLURM's requeue, scancel or time limit) saves and stops without requeueing. So the warning
    must come two optimizer steps plus one save before the end (step s's own periodic save or
    validation, if due, still runs).
    """

    def __init__(self, checkpoint_path: str, signum: int = signal.SIGUSR1,
                 requeue_command: str = "scontrol requeue {job_id}",
                 timeout: timedelta | None = None):
        self.checkpoint_path, self.signum, self.requeue_command = checkpoint_path, signum, requeue_command
        self.timeout = timeout  # of the flags' group: the run's process-group timeout
        self.received = NONE  # what this process got (TERMINATE or REQUEUE)
        self.preempted = False  # the run saved and stopped because of it
        self.step = 0  # the optimizer step of the last step boundary seen
        self.group = None  # the CPU process group of the flags (several ranks)
        self._pending = None  # (flags, work) of the all-reduce started at the last boundary
        self._previous_handler = None  # of `signum`, restored by release()

    def setup(self, trainer, pl_module, stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(self.signum, self._on_signal)
        if trainer.world_size > 1 and stage == "fit":
            # The flags travel on the CPU (a gloo group beside NCCL's): reading one never makes
            # the host wait for the GPU. Every rank creates the group here, in the same order.
            self.group = dist.new_group(backend="gloo", timeout=self.timeout)

    def _on_signal(self, signum, frame) -> None:
        self.received = max(self.received, REQUEUE if signum == self.signum else TERMINATE)

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step  # a resumed run starts past 0
        # Lightning installs its SIGTERM handler just before training: it broadcasts a flag from
        # inside the handler, while the other ranks may be in another collective (a hang), and it
        # makes every micro batch broadcast that flag and read it (`.item()`, a host-GPU sync).
        # Here SIGTERM sets this callback's flag like the warning signal, and Lightning's
        # per-batch broadcast (of a flag now never set) is skipped.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # The run goes on after fit (export, evaluation, metrics.json), and the warning may come
        # now: launch/train.sbatch asks for it 120 s before the limit, and SIGUSR1's default
        # action terminates. Until `release`, a late warning is logged and changes nothing: there
        # is no training left to save, and what follows is shorter than a requeued job's restart.
        # SIGTERM's handler goes back with Lightning's own (it restores what it found).
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._after_training)

    def _after_training(self, signum, frame) -> None:
        log.warning("%s after training: ignored; the export, the evaluation and metrics.json "
                    "go on", signal.Signals(signum).name)

    def release(self) -> None:
        """The warning signal's handler from before `setup`, back (the run is over: train() calls
        this after metrics.json, on every rank)."""
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._previous_handler)
            self._previous_handler = None

    def _any_rank_received(self) -> int:
        """The largest flag of any rank as of the previous boundary (SLURM may signal only some
        ranks: any rank's stops all), and this boundary's flags sent on their way. A blocking
        all-reduce here would be a host barrier at every step on a GPU cluster, where the
        gradients' reduction runs on the GPU's stream and the hosts otherwise never meet; the one
        started a step ago has long arrived, so `wait` returns at once."""
        flag = torch.tensor([self.received], dtype=torch.int32)
        if self.group is None:
            return int(flag.numpy()[0])
        previous = self._collect()
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group,
                                               async_op=True))
        return previous

    def _collect(self) -> int:
        """The result of the all-reduce in flight (NONE if none): every rank waits for its own."""
        if self._pending is None:
            return NONE
        flag, work = self._pending
        self._pending = None
        work.wait()
        return int(flag.numpy()[0])  # a CPU tensor: numpy() refuses a device tensor, no sync

    def on_train_end(self, trainer, pl_module) -> None:
        # No collective may be in flight when the ranks leave the process group.
        self._collect()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            return  # mid-accumulation: no optimizer step since the last boundary
        self.step = trainer.global_step
        received = self._any_rank_received()
        if not received:
            return
        log.warning("preemption (%s): saving %s at step %d",
                    "requeue signal" if received == REQUEUE else "SIGTERM", self.checkpoint_path,
                    trainer.global_step)
        # the full state (optimizer, loops, stream) to resume from; said, or Lightning logs its default
        trainer.save_checkpoint(self.checkpoint_path, weights_only=False)
        self.preempted = True
        stop_without_validation_or_checkpoints(trainer)
        job_id = slurm_job_id()
        if received == REQUEUE and trainer.is_global_zero and job_id and self.requeue_command:
            command = shlex.split(self.requeue_command.format(job_id=job_id))
            result = subprocess.run(command, check=False)
            log.warning("requeue: %s -> exit %d", " ".join(command), result.returncode)


def stop_without_validation_or_checkpoints(trainer) -> None:
    """Training stops after this step, and nothing else saves or validates in this run.

    `should_stop` alone means early stopping to Lightning: it validates first, and then the best
    checkpoint may be written, and the last-checkpoint callback saves at this step or at the end
    of training: minutes past the warning on a large model. The checkpoint callbacks leave the
    trainer's list in place: Lightning sorts them after every other callback, so those still to
    run in this very hook are skipped too.
    """
    trainer.should_stop = True
    trainer.limit_val_batches = 0
    trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, Checkpoint)]
