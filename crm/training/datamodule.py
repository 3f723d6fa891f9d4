"""The LightningDataModule over the shard stream (crm.data)."""
from __future__ import annotations

from dataclasses import replace

import lightning as L

from crm.data.manifest import Manifest
from crm.data.config import StreamConfig
from crm.data.stream import PairStream, StreamLoader
from crm.data.transforms import TransformConfig, check_one_sided


class _RestartingLoader(StreamLoader):
    """A validation loader: every pass reads the split from its start.

    Lightning iterates the same val loader at every validation, and the sanity check (or
    limit_val_batches) stops it part way; a StreamLoader would resume where that pass stopped.
    """

    def __iter__(self):
        self.epoch, self.batches_done = 0, 0
        return super().__iter__()


class CRMDataModule(L.LightningDataModule):
    """Train and validation streams from a shard directory made by `crm-data shard`, from its
    manifest (crm.data.manifest.load_manifest).

    Each rank builds its own stream from the trainer's rank and world size; the train loader is
    stateful, so Lightning checkpoints its position and a resumed run continues mid-epoch.
    """

    def __init__(self, manifest: Manifest, tokenizer, stream: StreamConfig,
                 transform: TransformConfig, val_split: str = "val", step_batches: int = 1):
        super().__init__()
        self.manifest = manifest
        if self.manifest.one_sided:
            check_one_sided(transform)  # here, at start: the loaders are built inside fit
        self.tokenizer, self.stream, self.transform = tokenizer, stream, transform
        self.val_split, self.step_batches = val_split, step_batches  # micro batches per optimizer step
        self.train_loader: StreamLoader | None = None

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer else (0, 1)

    def _loader(self, split: str, stream: StreamConfig, transform: TransformConfig,
                loader: type[StreamLoader] = StreamLoader, step_batches: int = 1) -> StreamLoader:
        rank, world = self._rank_world()
        dataset = PairStream(self.manifest.shards(split), self.tokenizer, stream, transform,
                             self.manifest.criteria_pool, rank=rank, world=world)
        return loader(dataset, num_workers=stream.num_workers, step_batches=step_batches)

    def train_dataloader(self) -> StreamLoader:
        self.train_loader = self._loader("train", self.stream, self.transform,
                                         step_batches=self.step_batches)
        return self.train_loader

    def val_dataloader(self) -> StreamLoader:
        # Validation sees a fixed order and one fixed draw per record, under the run's final
        # direction, so its loss is comparable across evaluations.
        return self._loader(self.val_split, replace(self.stream, shuffle=False),
                            replace(self.transform, warmup_batches=0), _RestartingLoader)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        # Lightning fetches one batch ahead; a batch is consumed when it reaches the step, so the
        # checkpointed stream position is the trained one, not the prefetched one.
        if self.trainer is not None and self.trainer.training and self.train_loader is not None:
            self.train_loader.mark_consumed(batch["position"])
        return batch
