"""A callback the distributed tests add to crm-train (`+callbacks.probe._target_=probe.Probe`, with
tests/dist on PYTHONPATH): what only the ranks of a run can show, written to `$PROBE_DIR`.

- The gradient collectives FSDP2 issues while training, by kind and group size, with the number
  of optimizer steps they served: `reduce_scatter/<n>` (FSDP's, within the shard group of n) and
  `all_reduce/<n>` (HSDP's across the replicas, and crm's own step and metric sums over the world).
- The examples of each micro batch each rank trained (what the length policy left in it).
- The full model and optimizer state (every rank takes part in gathering it) when training starts
  and ends: a resumed run's start is the state it loaded, the saving run's end the state it saved.

Written by global rank 0 as `probe-<name>.json`: {"steps", "counts", "examples" (per rank, per
micro batch), "start", "end"}, each state as
{name: [sum, sum of |x|]} for the weights and the AdamW moments.
"""
from __future__ import annotations

import json
import os
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


class Probe(L.Callback):
    def __init__(self, name: str = "run"):
        self.name, self.counts, self.start_step = name, Counter(), 0
        self.examples: list[int] = []
        self.report: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.examples.append(len(batch["keys"]))

    def _counting(self, kind: str, collective):
        def wrapper(*args, **kwargs):
            self.counts[f"{kind}/{dist.get_world_size(kwargs.get('group'))}"] += 1
            return collective(*args, **kwargs)
        return wrapper

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step
        self.report["start"] = _fingerprint(pl_module, trainer.optimizers[0])
        # FSDP2 calls them through the module (torch.distributed.<name>) at every use.
        self._originals = {"reduce_scatter_single": dist.reduce_scatter_single,
                           "all_reduce": dist.all_reduce}
        dist.reduce_scatter_single = self._counting("reduce_scatter", dist.reduce_scatter_single)
        dist.all_reduce = self._counting("all_reduce", dist.all_reduce)

    def on_train_end(self, trainer, pl_module) -> None:
        for name, collective in self._originals.items():
            setattr(dist, name, collective)
        examples = [None] * trainer.world_size
        dist.all_gather_object(examples, self.examples)
        self.report.update(steps=trainer.global_step - self.start_step, counts=dict(self.counts),
                           examples=examples, end=_fingerprint(pl_module, trainer.optimizers[0]))
        if trainer.is_global_zero:
            out = Path(os.environ["PROBE_DIR"]) / f"probe-{self.name}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(self.report))
