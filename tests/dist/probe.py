"""A callback the distributed tests add to crm-train (`+callbacks.probe._target_=probe.Probe`, with
tests/dist on PYTHONPATH): what only the ranks of a run can show, written to `$PROBE_DIR`.

- The gradient collectives FSDP2 issues while training, by kind and group size, with the number
  of optimizer steps they served: `reduce_scatter/<n>` (FSDP's, within the shard group of n) and
  `all_reduce/<n>` (HSDP's across the replicas, and crm's own step and metric sums over the world).
- The examples of each micro batch each rank trained (what the length policy left in it).
- The full model and optimizer state (every rank takes part in gathering it) when training starts
  and ends: a resumed run's start is the state it loaded, the saving run's end the state it saved.

- The census of what may make the host wait, per rank and micro batch: every `Tensor.item()` and
  `Tensor.tolist()` (on a GPU tensor, a host-GPU sync), `barrier`, and every other collective by
  its group: `world` (the default group), `flags` (the preemption callback's gloo group) or
  `group` (another: FSDP's mesh groups), with `-async` where it was started without waiting
  (`async_op=True`). A micro batch's window runs from its
  on_train_batch_start to the next one's (what Lightning does around the batch included).

- Events in order, per rank: ["signal", step] (the probe signalled this rank: `$PROBE_SIGNAL` =
  `<global rank>:<optimizer step>:<signal name>` sends it after the first micro batch of that
  step, mid-accumulation), ["save", step] (any checkpoint written), ["validation", step] (or
  "validation mid-step": between the micro batches of a step).

Written by global rank 0 as `probe-<name>.json`: {"steps", "counts", "examples" (per rank, per
micro batch), "census" (per rank, per micro batch: {"step" (the optimizer step it belongs to, from
1), "step_index", "step_batches", "counts"}), "start", "end"}, each state as
{name: [sum, sum of |x|]} for the weights and the AdamW moments.
"""
from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist


def _fingerprint(module: torch.nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole on rank 0, {} elsewhere
    weights = get_model_state_dict(module, options=options)
    moments = {}
    if optimizer.state:  # before a first step torch would initialise the state with a step of its own
        moments = get_optimizer_state_dict(module, optimizer, options=options).get("state", {})
    out = {f"weight:{k}": [v.double().sum().item(), v.double().abs().sum().item()]
           for k, v in weights.items()}
    for name, state in moments.items():
        for key in ("exp_avg", "exp_avg_sq"):
            v = state[key]
            out[f"{key}:{name}"] = [v.double().sum().item(), v.double().abs().sum().item()]
    return out


def _every_rank(obj, world: int) -> list:
    if world == 1:
        return [obj]
    gathered = [None] * world
    dist.all_gather_object(gathered, obj)
    return gathered


CENSUS_COLLECTIVES = ("barrier", "all_reduce", "broadcast", "all_gather", "all_gather_object",
                      "broadcast_object_list", "reduce", "gather")
CENSUS_READS = ("item", "tolist")


def optimizer_step_told_apart(owner, step):
    """The optimizer's step, its own reads told apart by `owner.in_optimizer`: on the CPU torch's
    AdamW reads its step counters (CPU tensors) with `.item()`; on CUDA crm's fused AdamW keeps
    them on the device and reads none. Lightning runs the training step of a step's last micro
    batch inside optimizer.step (the closure): that part is not the optimizer's."""
    def wrapper(closure=None, **kwargs):
        def training_part():
            owner.in_optimizer = False
            try:
                return closure()
            finally:
                owner.in_optimizer = True
        owner.in_optimizer = True
        try:
            return step(closure=training_part if closure else None, **kwargs)
        finally:
            owner.in_optimizer = False
    return wrapper


class Probe(L.Callback):
    def __init__(self, name: str = "run"):
        self.name, self.counts, self.start_step = name, Counter(), 0
        self.examples: list[int] = []
        self.census: list[dict] = []
        self.window = Counter()  # the census of the micro batch in flight
        self.flags_group = None
        self.in_optimizer = False
        self.events: list[list] = []
        self.report: dict = {}
        rank, step, signame = (os.environ.get("PROBE_SIGNAL") or "-1:0:SIGUSR1").split(":")
        self.signal_at = (int(rank), int(step), getattr(signal, signame))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rank, step, signum = self.signal_at
        if (trainer.global_rank, trainer.global_step + 1) == (rank, step) and batch["step_index"] == 0:
            self.events.append(["signal", step])
            os.kill(os.getpid(), signum)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.events.append(["save", trainer.global_step])

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        last = self.census[-1] if self.census else None  # the micro batch trained before it
        mid_step = last is not None and last["step_index"] != last["step_batches"] - 1
        self.events.append(["validation mid-step" if mid_step else "validation", trainer.global_step])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.examples.append(len(batch["keys"]))
        self.window = Counter()
        self.census.append({"step": trainer.global_step + 1, "step_index": int(batch["step_index"]),
                            "step_batches": int(batch["step_batches"]), "counts": self.window})

    def _group_name(self, group) -> str:
        if group is None or group is dist.group.WORLD:
            return "world"
        return "flags" if group is self.flags_group else "group"

    def _counting(self, kind: str, collective):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            if kind in ("all_reduce", "reduce_scatter"):  # the gradient counts, by group size
                self.counts[f"{kind}/{dist.get_world_size(group)}"] += 1
            if kind != "reduce_scatter":  # FSDP's gradient reduction is counted above only
                name = kind if kind == "barrier" else f"{kind}/{self._group_name(group)}"
                self.window[name + ("-async" if kwargs.get("async_op") else "")] += 1
            return collective(*args, **kwargs)
        return wrapper

    def _reading(self, kind: str, read):
        def wrapper(tensor, *args, **kwargs):
            self.window[f"{kind}/optimizer" if self.in_optimizer else kind] += 1
            return read(tensor, *args, **kwargs)
        return wrapper

    def on_train_start(self, trainer, pl_module) -> None:
        from crm.training.preemption import Preemption

        self.start_step = trainer.global_step
        self.report["start"] = _fingerprint(pl_module, trainer.optimizers[0])
        self.flags_group = next(c.group for c in trainer.callbacks if isinstance(c, Preemption))
        # FSDP2 and Lightning call them through the module (torch.distributed.<name>) at every use.
        self._originals = {name: getattr(dist, name)
                           for name in ("reduce_scatter_single", *CENSUS_COLLECTIVES)}
        dist.reduce_scatter_single = self._counting("reduce_scatter", dist.reduce_scatter_single)
        for name in CENSUS_COLLECTIVES:
            setattr(dist, name, self._counting(name, getattr(dist, name)))
        optimizer = trainer.optimizers[0]
        optimizer.step = optimizer_step_told_apart(self, optimizer.step)
        self._reads = {name: getattr(torch.Tensor, name) for name in CENSUS_READS}
        for name, read in self._reads.items():
            setattr(torch.Tensor, name, self._reading(name, read))

    def on_train_end(self, trainer, pl_module) -> None:
        for name, collective in self._originals.items():
            setattr(dist, name, collective)
        for name, read in self._reads.items():
            setattr(torch.Tensor, name, read)
        examples, census, events = (_every_rank(x, trainer.world_size) for x in (
            self.examples, [{**w, "counts": dict(w["counts"])} for w in self.census], self.events))
        self.report.update(steps=trainer.global_step - self.start_step, counts=dict(self.counts),
                           examples=examples, census=census, events=events,
                           end=_fingerprint(pl_module, trainer.optimizers[0]))
        if trainer.is_global_zero:
            out = Path(os.environ["PROBE_DIR"]) / f"probe-{self.name}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(self.report))
