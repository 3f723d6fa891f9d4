"""One process trained on the global batches of a 2-rank run: the reference loss curve and weights.

`python tests/dist/single_reference.py <crm-train overrides>` runs crm-train itself (same config,
seed, model build, optimizer, schedule, checkpoints, metrics.json) with one change: the train
loader yields, at step k, rank 0's batch k followed by rank 1's batch k of a 2-rank run (two
PairStreams with rank=0/1, world=2, re-padded to one width). Pass `micro_batch_size` = the 2-rank
run's global batch (accumulation 1): each rank's stream takes half of it.

The 2-rank runs average their ranks' mean losses (DDP/FSDP average the gradients, train/loss is
logged with sync_dist); that equals this run's mean over the union when both ranks' batches hold
the same number of examples, so choose a record count divisible by 2 x the rank micro batch.
"""
from __future__ import annotations

from dataclasses import replace

import torch

import crm.cli.train
from crm.data.stream import PairStream, StreamLoader
from crm.training.datamodule import CRMDataModule
from crm.data.padding import pad_rows

WORLD = 2


def concat_batches(batches: list[dict], pad_id: int) -> dict:
    """The rows of `batches`, right-padded to one width; counters summed.

    Pairwise: rank 0's rows, then rank 1's. Pointwise keeps the chosen-then-rejected layout: every
    rank's chosen rows, then every rank's rejected rows in the same order.
    """
    per_batch = [[ids[mask.bool()].tolist() for ids, mask in zip(b["input_ids"], b["attention_mask"])]
                 for b in batches]
    if "labels" in batches[0]:
        rows = [r for b in per_batch for r in b]
    else:
        rows = ([r for b in per_batch for r in b[:len(b) // 2]]
                + [r for b in per_batch for r in b[len(b) // 2:]])
    out = pad_rows(rows, pad_id)
    out.update(keys=[k for b in batches for k in b["keys"]], position=batches[0]["position"],
               **{name: sum(b[name] for b in batches) for name in ("shortened", "dropped")})
    if "labels" in batches[0]:
        out["labels"] = torch.cat([b["labels"] for b in batches])
    return out


class GlobalBatches:
    """Iterates the ranks' streams in lock step, one concatenated batch per step; epoch by epoch."""

    def __init__(self, streams: list[PairStream], pad_id: int):
        self.streams, self.pad_id, self.epoch = streams, pad_id, 0

    def __len__(self) -> int:
        return len(self.streams[0])

    def __iter__(self):
        loaders = []
        for stream in self.streams:
            loader = StreamLoader(stream)
            loader.epoch = self.epoch
            loaders.append(loader)
        for batches in zip(*loaders, strict=True):
            yield concat_batches(list(batches), self.pad_id)
        self.epoch += 1


class GlobalBatchDataModule(CRMDataModule):
    def train_dataloader(self):
        if self.stream.batch_size % WORLD:
            raise ValueError(f"micro_batch_size={self.stream.batch_size}: not divisible by {WORLD}")
        stream = replace(self.stream, batch_size=self.stream.batch_size // WORLD)
        streams = [PairStream(self.manifest.shards("train"), self.tokenizer, stream, self.transform,
                              self.manifest.criteria_pool, rank=rank, world=WORLD)
                   for rank in range(WORLD)]
        return GlobalBatches(streams, self.tokenizer.pad_token_id)


if __name__ == "__main__":
    torch.set_num_threads(1)
    crm.cli.train.CRMDataModule = GlobalBatchDataModule
    crm.cli.train.main()
