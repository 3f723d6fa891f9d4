"""The training stream: shards -> rank range -> shuffle -> length-grouped batches -> transforms ->
prompts -> token ids, in DataLoader workers.

Exactly once per epoch, for any shard count, world size and worker count:
- `plan.plan_rank` gives each rank a contiguous range of the epoch's record sequence and the same
  number of batches K (see plan.py for why records, not shards, are split).
- Every worker of a rank reads the rank's whole range (JSON parsing is cheap next to tokenizing)
  and forms the same batches in the same order; worker w keeps batch j when (j - skip) % V == w,
  which is the order in which the DataLoader asks its workers. So batch composition depends only on
  (seed, epoch, rank, world), not on the worker count, and skipping the first `skip` batches resumes
  mid-epoch without replaying or losing a record.
"""
from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from crm.data.manifest import ShardInfo
from crm.data.plan import RankPlan, plan_rank
from crm.data.reader import ShardError, iter_shard_raw, load_member
from crm.prompts import LengthStats, PromptEncoder, PromptTemplate
from crm.records import RecordError, TrainRecord, parse_train
from crm.transforms import (LABEL_A, CriteriaPool, PairExample, TransformConfig, record_rng,
                            train_example)

MODES = ("pairwise", "pointwise")


@dataclass(frozen=True)
class StreamConfig:
    batch_size: int  # records per batch on one rank (the micro batch)
    mode: str = "pairwise"  # pointwise: each record gives a chosen and a rejected row, in one batch
    seed: int = 0
    shuffle: bool = True  # False for validation: a fixed order, epoch 0's draws
    shuffle_buffer: int = 2048  # records mixed across shard boundaries
    window_batches: int = 32  # length grouping: sort this many batches' worth of records by length
    max_tokens: int = 1024  # length policy limit of one row
    min_turn_tokens: int = 16  # the least a shortened message keeps
    template: PromptTemplate = field(default_factory=PromptTemplate)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"stream mode={self.mode!r}: expected one of {MODES}")


class PairStream(IterableDataset):
    """Batches (dicts of tensors) for one rank; `len()` is the batch count K, equal on every rank."""

    def __init__(self, shards: list[ShardInfo], tokenizer, cfg: StreamConfig,
                 transform: TransformConfig, pool: CriteriaPool | None = None, rank: int = 0,
                 world: int = 1):
        if cfg.mode == "pointwise" and transform.ties == "keep":
            raise ValueError("pointwise training cannot use ties (a Bradley-Terry pair needs a "
                             "winner): set ties=drop")
        if transform.noise in ("add", "random") and pool is None:
            raise ValueError(f"noise={transform.noise!r} draws from a criteria pool: give the manifest's")
        self.shards, self.tokenizer, self.cfg, self.transform = shards, tokenizer, cfg, transform
        self.pool, self.rank, self.world = pool, rank, world
        self.epoch = 0
        self.skip = 0  # batches of this epoch already consumed (mid-epoch resume)
        self.plan(0)  # fail fast, in the main process, on a setting that cannot be planned

    def plan(self, epoch: int) -> RankPlan:
        return plan_rank(self.shards, rank=self.rank, world=self.world,
                         batch_size=self.cfg.batch_size, keep_ties=self.transform.ties == "keep",
                         seed=self.cfg.seed, epoch=epoch, shuffle=self.cfg.shuffle)

    def __len__(self) -> int:
        return len(self.plan(self.epoch).sizes)

    # -- records ---------------------------------------------------------------------------------

    def _records(self, plan: RankPlan) -> Iterator[tuple[str, str, dict, int]]:
        """(shard url, key, raw JSON object, byte length) of the plan's records, in plan order.

        Records are parsed into TrainRecords only in the batches a worker keeps.
        """
        keep_ties = self.transform.ties == "keep"
        for seg in plan.segments:
            url, seen, taken = seg.shard.url, 0, 0
            for key, data in iter_shard_raw(url):
                obj = load_member(url, key, data)
                if not keep_ties and isinstance(obj, dict) and obj.get("human_winner") == "tie":
                    continue
                seen += 1
                if seen <= seg.skip:
                    continue
                yield url, key, obj, len(data)
                taken += 1
                if taken == seg.take:
                    break
            if taken < seg.take:
                raise ShardError(f"{url}: {seen} eligible records, the manifest promised "
                                 f"{seg.skip + seg.take} or more")

    def _shuffled(self, items: Iterator, rng: random.Random) -> Iterator:
        buffer = []
        for item in items:
            if len(buffer) < self.cfg.shuffle_buffer:
                buffer.append(item)
                continue
            i = rng.randrange(len(buffer))
            yield buffer[i]
            buffer[i] = item
        rng.shuffle(buffer)
        yield from buffer

    def batches_of_records(self, epoch: int) -> Iterator[list[tuple[str, str, dict, int]]]:
        """The rank's batches of records for `epoch`, in yield order (every worker computes it)."""
        plan = self.plan(epoch)
        rng = random.Random(f"stream:{self.cfg.seed}:{epoch}:{self.rank}")
        records = self._records(plan)
        if self.cfg.shuffle:
            records = self._shuffled(records, rng)
        sizes = plan.sizes
        for w in range(0, len(sizes), self.cfg.window_batches):
            window_sizes = sizes[w:w + self.cfg.window_batches]
            window = [next(records) for _ in range(sum(window_sizes))]
            window.sort(key=lambda rec: rec[3])  # bytes: a cheap stand-in for the token length
            batches, i = [], 0
            for size in window_sizes:
                batches.append(window[i:i + size])
                i += size
            if self.cfg.shuffle:
                rng.shuffle(batches)
            yield from batches

    # -- examples and tensors --------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        epoch, skip = self.epoch, self.skip
        draw_epoch = epoch if self.cfg.shuffle and self.transform.redraw_each_epoch else 0
        encoder = PromptEncoder(self.tokenizer, self.cfg.template, self.cfg.max_tokens,
                                self.cfg.min_turn_tokens)
        batches_before = epoch * len(self)  # K is the same every epoch: the run's batch index
        for j, batch in enumerate(self.batches_of_records(epoch)):
            if j < skip or (j - skip) % workers != worker:
                continue
            transform = self.transform.at_batch(batches_before + j)
            examples = [train_example(self._parse(url, key, obj), key, transform,
                                      record_rng(self.cfg.seed, draw_epoch, key), self.pool)
                        for url, key, obj, _ in batch]
            yield self.collate(examples, encoder, position=(epoch, j))

    @staticmethod
    def _parse(url: str, key: str, obj) -> TrainRecord:
        try:
            return parse_train(obj)
        except RecordError as err:
            raise ShardError(f"{url}: sample {key}: {err}") from None

    def collate(self, examples: list[PairExample], encoder: PromptEncoder, position) -> dict:
        stats = encoder.stats = LengthStats()  # this batch's counts
        if self.cfg.mode == "pairwise":
            encoded = encoder.pairwise_many([(ex.criteria, ex.query, ex.conv_a, ex.conv_b)
                                             for ex in examples])
            kept = [(ex, ids) for ex, ids in zip(examples, encoded) if ids is not None]
            rows = [ids for _, ids in kept]
            labels = [ex.label for ex, _ in kept]
        else:
            pairs = [(ex.conv_a, ex.conv_b) if ex.label == LABEL_A else (ex.conv_b, ex.conv_a)
                     for ex in examples]  # (chosen, rejected); ties were refused in __init__
            encoded = encoder.pointwise_many([(ex.criteria, ex.query, conv) for ex, pair in
                                              zip(examples, pairs) for conv in pair])
            kept = [(ex, c, r) for ex, c, r in zip(examples, encoded[0::2], encoded[1::2])
                    if c is not None and r is not None]
            # One forward: chosen rows first, then their rejected rows in the same order.
            rows = [c for _, c, _ in kept] + [r for _, _, r in kept]
        keys = [k[0].key for k in kept]
        batch = pad_rows(rows, self.tokenizer.pad_token_id)
        batch.update(
            keys=keys,
            position=torch.tensor(position),
            rendered=torch.tensor(stats.rendered),  # prompts (two per record when pointwise)
            shortened=torch.tensor(stats.shortened),
            dropped=torch.tensor(len(examples) - len(keys)),  # examples lost to the length policy
        )
        if self.cfg.mode == "pairwise":
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        return batch


def pad_rows(rows: list[list[int]], pad_id: int) -> dict:
    """Right-padded input_ids and attention_mask; the head reads each row's last real token."""
    width = max((len(r) for r in rows), default=1)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, :len(r)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _ignore_preemption_signals(worker_id: int) -> None:
    # SLURM signals every process of a task. The training process handles the warning (saves and
    # stops); a worker started by spawn/forkserver would otherwise die of it first.
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)


class StreamLoader:
    """A DataLoader over a PairStream that knows its epoch and position, for mid-epoch resume.

    Workers are re-created each epoch (never persistent) so that each epoch's workers receive the
    current epoch and skip. Lightning saves `state_dict()` in checkpoints and calls
    `load_state_dict()` on resume because this object has both.
    """

    def __init__(self, dataset: PairStream, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int | None = None):
        self.dataset = dataset
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self.epoch = 0
        self.batches_done = 0  # batches of `epoch` handed out (or restored)
        if num_workers:
            # The tokenizer's own thread pool does not survive fork (a worker forked with
            # TOKENIZERS_PARALLELISM=true hangs); workers are the parallelism.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[dict]:
        epoch = self.dataset.epoch = self.epoch
        self.dataset.skip = self.batches_done
        loader = DataLoader(self.dataset, batch_size=None, num_workers=self.num_workers,
                            pin_memory=self.pin_memory, prefetch_factor=self.prefetch_factor,
                            persistent_workers=False, worker_init_fn=_ignore_preemption_signals)
        batches = iter(loader)
        try:
            for batch in batches:
                self.batches_done += 1
                yield batch
        finally:
            # On an error or an early stop, stop the workers now; left to the garbage collector,
            # each worker's join times out after seconds.
            getattr(batches, "_shutdown_workers", lambda: None)()
        self.epoch, self.batches_done = epoch + 1, 0

    def mark_consumed(self, position) -> None:
        """Record that the batch at `position` (its `batch["position"]`) has been trained on.

        A trainer that prefetches has taken more batches than it has trained; calling this after
        each step makes the saved state the trained position.
        """
        epoch, j = (int(x) for x in position)
        self.epoch, self.batches_done = epoch, j + 1
        if self.batches_done == len(self.dataset.plan(epoch).sizes):
            self.epoch, self.batches_done = epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done, "world": self.dataset.world,
                "batch_size": self.dataset.cfg.batch_size, "seed": self.dataset.cfg.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["batches_done"] and (state["world"], state["batch_size"], state["seed"]) != (
                self.dataset.world, self.dataset.cfg.batch_size, self.dataset.cfg.seed):
            raise ValueError(
                f"cannot resume mid-epoch: the stream was at batch {state['batches_done']} of epoch "
                f"{state['epoch']} with world size {state['world']}, micro batch "
                f"{state['batch_size']}, seed {state['seed']}; now {self.dataset.world}, "
                f"{self.dataset.cfg.batch_size}, {self.dataset.cfg.seed}. A mid-epoch position only "
                "means the same records under the same plan; resume from an epoch-end checkpoint")
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]
