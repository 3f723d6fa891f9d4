"""Preemption: on SLURM's warning signal, checkpoint at the next step boundary, requeue, stop.

One owner of the signal: Lightning's own SLURM auto-requeue is switched off (it saves inside the
signal handler, possibly mid-step, while other ranks may be inside a collective), and sweeps over
the submitit launcher leave requeueing to this callback too (SLURM.md).
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import threading

import lightning as L
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def slurm_job_id() -> str | None:
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return os.environ.get("SLURM_JOB_ID")


class Preemption(L.Callback):
    """The handler only sets a flag; the save happens where every rank is at the same point (after
    an optimizer step), so the checkpoint's weights, optimizer and stream position agree.

    `requeue_command` runs on global rank 0 after the save, with `{job_id}` filled in; with no
    SLURM job id it is skipped (a local run just stops with its checkpoint).
    """

    def __init__(self, checkpoint_path: str, signum: int = signal.SIGUSR1,
                 requeue_command: str = "scontrol requeue {job_id}"):
        self.checkpoint_path, self.signum, self.requeue_command = checkpoint_path, signum, requeue_command
        self.received = False  # this process got the signal
        self.preempted = False  # the run saved and stopped because of it
        self.step = 0  # the optimizer step of the last step boundary seen
        self.group = None  # the CPU process group of the flags (several ranks)
        self.in_flight: tuple | None = None  # (work, flag) of the last boundary's all-reduce

    def setup(self, trainer, pl_module, stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._on_signal)
        if trainer.world_size > 1 and stage == "fit":
            # The flags travel on the CPU (a gloo group beside NCCL's): reading one never makes
            # the host wait for the GPU. Every rank creates the group here, in the same order.
            self.group = dist.new_group(backend="gloo")

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step  # a resumed run starts past 0

    def on_train_end(self, trainer, pl_module) -> None:
        if self.in_flight is not None:  # every rank sent it: collect it before the group goes
            self.in_flight[0].wait()
            self.in_flight = None

    def _any_rank_received(self) -> bool:
        """Whether any rank had the signal (SLURM may signal only some ranks: any rank's stops all).

        Each step boundary sends this rank's flag without waiting and reads the sum sent at the
        previous boundary, long since arrived: no rank waits on another for it, and every rank
        reads the same sum at the same step. The save comes one step after the signal.
        """
        if self.group is None:
            return self.received
        anyone = False
        if self.in_flight is not None:
            work, flag = self.in_flight
            work.wait()
            anyone = bool(flag.item() > 0)
        flag = torch.tensor([float(self.received)])
        self.in_flight = (dist.all_reduce(flag, group=self.group, async_op=True), flag)
        return anyone

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            return  # mid-accumulation: no optimizer step since the last boundary
        self.step = trainer.global_step
        if not self._any_rank_received():
            return
        log.warning("preemption signal: saving %s at step %d", self.checkpoint_path, trainer.global_step)
        trainer.save_checkpoint(self.checkpoint_path)
        self.preempted = True
        trainer.should_stop = True
        job_id = slurm_job_id()
        if trainer.is_global_zero and job_id and self.requeue_command:
            command = shlex.split(self.requeue_command.format(job_id=job_id))
            result = subprocess.run(command, check=False)
            log.warning("requeue: %s -> exit %d", " ".join(command), result.returncode)
