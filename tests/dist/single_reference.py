"""One process trained on the global batches of a multi-rank run: the reference loss curve and weights.

`python tests/dist/single_reference.py <crm-train overrides>` runs crm-train itself (same config,
seed, model build, optimizer, schedule, checkpoints, metrics.json) with one change: the train
loader yields, at optimizer step k, the union of the micro batches that every rank of a
REFERENCE_WORLD-rank run (default 2) trains at step k under REFERENCE_ACCUMULATION (default 1)
micro batches a step: rank 0's, then rank 1's, ..., each rank's in its order, re-padded to one
width. Pass `micro_batch_size` = the multi-rank run's global batch (accumulation 1 here): each
rank's stream takes micro_batch_size / (world x accumulation) records a micro batch.

crm-train's loss is the sum over a step's examples divided by their count on every rank and
micro batch, so the multi-rank run's gradients equal this run's whatever the length policy
dropped where (docs/DESIGN.md section 9).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import replace

import torch

import crm.cli.train
import crm.training.datamodule
from crm.data.stream import PairStream, StreamLoader
from crm.training.datamodule import CRMDataModule
from crm.data.padding import pad_rows

WORLD = int(os.environ.get("REFERENCE_WORLD", "2"))
ACCUMULATION = int(os.environ.get("REFERENCE_ACCUMULATION", "1"))


def concat_batches(batches: list[dict], pad_id: int, step: int = 0) -> dict:
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
    keys = [k for b in batches for k in b["keys"]]
    out.update(keys=keys, position=batches[0]["position"], step_examples=torch.tensor(len(keys)),
               step_index=0, step_batches=1, epoch_index=step,
               **{name: sum(b[name] for b in batches) for name in ("shortened", "dropped")})
    if "labels" in batches[0]:
        out["labels"] = torch.cat([b["labels"] for b in batches])
    return out


class GlobalBatches:
    """Iterates the ranks' streams in lock step, one concatenated batch per optimizer step (each
    rank's ACCUMULATION micro batches, the epoch's last step possibly fewer); epoch by epoch."""

    def __init__(self, streams: list[PairStream], pad_id: int):
        self.streams, self.pad_id, self.epoch = streams, pad_id, 0

    def __len__(self) -> int:
        return -(-len(self.streams[0]) // ACCUMULATION)

    def __iter__(self):
        loaders = []
        for stream in self.streams:
            loader = StreamLoader(stream)
            loader.epoch = self.epoch
            loaders.append(iter(loader))
        for step in itertools.count():
            per_rank = [list(itertools.islice(loader, ACCUMULATION)) for loader in loaders]
            if not per_rank[0]:
                break
            yield concat_batches([b for rank in per_rank for b in rank], self.pad_id, step)
        self.epoch += 1


class GlobalBatchDataModule(CRMDataModule):
    def train_dataloader(self):
        parts = WORLD * ACCUMULATION
        if self.stream.batch_size % parts:
            raise ValueError(f"micro_batch_size={self.stream.batch_size}: not divisible by {parts}")
        # right padded whatever the run packs: the reference concatenates the ranks' rows
        stream = replace(self.stream, batch_size=self.stream.batch_size // parts, packing=False)
        streams = [PairStream(self.manifest.shards("train"), self.tokenizer, stream, self.transform,
                              self.manifest.criteria_pool, rank=rank, world=WORLD)
                   for rank in range(WORLD)]
        return GlobalBatches(streams, self.tokenizer.pad_token_id)


if __name__ == "__main__":
    torch.set_num_threads(1)
    # crm-train imports its data module inside `train` (its imports wait for its checks): the
    # module's attribute is what that import reads.
    crm.training.datamodule.CRMDataModule = GlobalBatchDataModule
    crm.cli.train.main()
