"""The training stream: shards -> rank range -> shuffle -> chunks -> transforms -> prompts -> token
ids (in DataLoader workers) -> length-grouped, padded batches (where the workers' output meets).

Exactly once per epoch, for any shard count, world size and worker count:
- `epoch_plan.plan_rank` gives each rank a contiguous range of the epoch's record sequence and the same
  number of batches K (see epoch_plan.py for why records, not shards, are split).
- Every worker of a rank reads the rank's whole range (JSON parsing is cheap next to tokenizing)
  and cuts it into the same K chunks (the plan's batch sizes, in draw order); worker w encodes
  chunk j when (j - start) % V == w, which is the order in which the DataLoader asks its workers.
- The loader's process gathers each window of `window_batches` chunks, sorts its records by
  encoded length and cuts them into that window's batches. So batch composition depends only on
  (seed, epoch, rank, world), not on the worker count, and every record is tokenized once.
- Resuming at batch `skip` re-encodes the window that holds it and drops the window's batches
  before `skip`: mid-epoch resume without replaying or losing a record.
"""
from __future__ import annotations

import math
import os
import random
import signal
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from crm.core.examples import LABEL_A, LABEL_B, LABEL_TIE, PairExample
from crm.core.prompts import PromptEncoder
from crm.core.records import RecordError, TrainRecord, parse_train
from crm.data.config import StreamConfig
from crm.data.epoch_plan import RankPlan, plan_rank
from crm.data.manifest import ShardInfo
from crm.data.packing import Budget, pack, split_shared
from crm.data.padding import pad_rows
from crm.core.errors import ShardError
from crm.data.reader import iter_shard_raw, load_member
from crm.data.transforms import (CriteriaPool, TransformConfig, check_one_sided, draws_from_pool, record_rng,
                                 train_example)

class Encoded(NamedTuple):
    """A record after transforms and the length policy, before batching (sent from the workers)."""

    key: str
    rows: tuple[list[int], ...] | None  # pairwise: (ids,); pointwise: (chosen, rejected); None: dropped
    label: int
    shortened: int  # its prompts that the length policy shortened

    def length(self) -> float:
        """The sort key of length grouping: the longest row (dropped records sort last)."""
        return max(map(len, self.rows)) if self.rows is not None else math.inf


class PairStream(IterableDataset):
    """One rank's stream: encoded chunks in workers (`__iter__`), length-grouped batches (dicts of
    tensors) where they meet (`batches`); `len()` is the batch count K, equal on every rank."""

    def __init__(self, shards: list[ShardInfo], tokenizer, cfg: StreamConfig,
                 transform: TransformConfig, pool: CriteriaPool | None = None, rank: int = 0,
                 world: int = 1):
        one_sided = any(s.one_sided for s in shards)
        if pool is None and draws_from_pool(transform.noise, one_sided):
            raise ValueError(f"noise={transform.noise!r} draws from a criteria pool: give the manifest's")
        if one_sided:
            check_one_sided(transform)
        self.shards, self.tokenizer, self.cfg, self.transform = shards, tokenizer, cfg, transform
        self.pool, self.rank, self.world = pool, rank, world
        self.epoch = 0
        self.skip = 0  # batches of this epoch already consumed (mid-epoch resume)
        self._plan: tuple[int, RankPlan] | None = None  # (epoch, its plan): the last one made
        self.plan(0)  # fail fast, in the main process, on a setting that cannot be planned

    def plan(self, epoch: int) -> RankPlan:
        """The rank's plan of `epoch`, made once: the loader asks for it at every micro batch
        (`StreamLoader.mark_consumed`), and a plan walks every shard and lists every batch."""
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, plan_rank(
                self.shards, rank=self.rank, world=self.world, batch_size=self.cfg.batch_size,
                keep_ties=self.transform.ties == "keep", seed=self.cfg.seed, epoch=epoch,
                shuffle=self.cfg.shuffle))
        return self._plan[1]

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
                # a README-format member has `preference` where the training format has `human_winner`
                winner = obj.get("human_winner", obj.get("preference")) if isinstance(obj, dict) else None
                if not keep_ties and winner == "tie":
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

    def chunks_of_records(self, epoch: int) -> Iterator[list[tuple[str, str, dict, int]]]:
        """The rank's records for `epoch`, in draw order, cut into the plan's batch sizes (chunks).

        Every worker computes this. Chunk j is not batch j: batches are cut from whole windows of
        encoded chunks, sorted by length (`batches`).
        """
        plan = self.plan(epoch)
        records = self._records(plan)
        if self.cfg.shuffle:
            records = self._shuffled(records, random.Random(f"stream:{self.cfg.seed}:{epoch}:{self.rank}"))
        for size in plan.sizes:
            yield [next(records) for _ in range(size)]

    def window_start(self, batch: int) -> int:
        """The first batch of the length-grouping window that holds `batch`."""
        return batch - batch % self.cfg.window_batches

    # -- encoded chunks (in DataLoader workers) ----------------------------------------------------

    def __iter__(self) -> Iterator[tuple[int, list[Encoded]]]:
        """(j, chunk j encoded) for the chunks of this worker, from the window of batch `skip` on."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        epoch, start = self.epoch, self.window_start(self.skip)
        draw_epoch = epoch if self.cfg.shuffle and self.transform.redraw_each_epoch else 0
        encoder = PromptEncoder(self.tokenizer, self.cfg.template, self.cfg.max_tokens,
                                self.cfg.min_turn_tokens)
        batches_before = epoch * len(self)  # K is the same every epoch: the run's batch index
        for j, chunk in enumerate(self.chunks_of_records(epoch)):
            if j < start or (j - start) % workers != worker:
                continue
            # A record's direction follows its chunk: the curriculum's first N batches' worth of
            # records, in draw order.
            transform = self.transform.at_batch(batches_before + j)
            examples = [train_example(self._parse(url, key, obj), key, transform,
                                      record_rng(self.cfg.seed, draw_epoch, key), self.pool)
                        for url, key, obj, _ in chunk]
            yield j, self.encode(examples, encoder)

    @staticmethod
    def _parse(url: str, key: str, obj) -> TrainRecord:
        try:
            return parse_train(obj)
        except RecordError as err:
            raise ShardError(f"{url}: sample {key}: {err}") from None

    def encode(self, examples: list[PairExample], encoder: PromptEncoder) -> list[Encoded]:
        if self.cfg.mode == "pairwise":
            fits = encoder.fit_pairwise([(ex.criteria, ex.query, ex.conv_a, ex.conv_b) for ex in examples])
            return [Encoded(ex.key, (fit.ids,) if fit.ids is not None else None, ex.label,
                            int(fit.shortened)) for ex, fit in zip(examples, fits)]
        # (chosen, rejected); a tie's two rows in the order shown (LABEL_TIE says which pairs)
        pairs = [(ex.conv_b, ex.conv_a) if ex.label == LABEL_B else (ex.conv_a, ex.conv_b)
                 for ex in examples]
        fits = encoder.fit_pointwise([(ex.criteria, ex.query, conv) for ex, pair in zip(examples, pairs)
                                      for conv in pair])
        out = []
        for ex, chosen, rejected in zip(examples, fits[0::2], fits[1::2]):
            rows = (chosen.ids, rejected.ids) if chosen.ids is not None and rejected.ids is not None else None
            out.append(Encoded(ex.key, rows, ex.label, chosen.shortened + rejected.shortened))
        return out

    # -- batches (in the loader's process) ---------------------------------------------------------

    def batches(self, chunks: Iterator[tuple[int, list[Encoded]]]) -> Iterator[dict]:
        """Length-grouped batches from the encoded chunks of `__iter__`, from batch `skip` on.

        A window's records are sorted by their encoded length (exact, not a byte estimate: the
        padded width of a batch is its longest row) and cut into the window's batch sizes; the
        batches of a window are then shuffled. This runs where all chunks meet, so each record is
        tokenized once however many workers there are.
        """
        epoch, skip = self.epoch, self.skip
        sizes = self.plan(epoch).sizes
        window: list[Encoded] = []
        for j, chunk in chunks:
            window.extend(chunk)
            last = min(self.window_start(j) + self.cfg.window_batches, len(sizes)) - 1
            if j < last:
                continue
            first = self.window_start(j)
            window.sort(key=Encoded.length)  # stable: equal lengths keep draw order
            batches, i = [], 0
            for size in sizes[first:last + 1]:
                batches.append(window[i:i + size])
                i += size
            if self.cfg.shuffle:
                random.Random(f"batches:{self.cfg.seed}:{epoch}:{self.rank}:{first}").shuffle(batches)
            for index, batch in enumerate(batches, start=first):
                if index >= skip:
                    yield self.collate(batch, position=(epoch, index))
            window = []

    def collate(self, examples: list[Encoded], position) -> dict:
        kept = [ex for ex in examples if ex.rows is not None]
        cfg = self.cfg
        if cfg.packing:  # pointwise: criteria + query once, the two responses as branches
            budget = None if cfg.token_budget is None else Budget(
                cfg.token_budget, records=cfg.batch_size, longest=cfg.max_tokens,
                fill=self.tokenizer.pad_token_id)
            batch = pack([ex.rows if len(ex.rows) == 1 else split_shared(*ex.rows) for ex in kept],
                         views=cfg.gather_views, budget=budget)
            batch["branched"] = cfg.mode == "pointwise"
        elif self.cfg.mode == "pairwise":
            batch = pad_rows([ex.rows[0] for ex in kept], self.tokenizer.pad_token_id)
        else:  # one forward: chosen rows first, then their rejected rows in the same order
            batch = pad_rows([ex.rows[0] for ex in kept] + [ex.rows[1] for ex in kept],
                             self.tokenizer.pad_token_id)
        batch.update(
            keys=[ex.key for ex in kept],
            position=torch.tensor(position),
            # plain ints: the trainer sums them on the host, with nothing sent to a device
            shortened=sum(ex.shortened for ex in examples),
            dropped=len(examples) - len(kept),  # examples lost to the length policy
        )
        if self.cfg.mode == "pairwise":
            batch["labels"] = torch.tensor([ex.label for ex in kept], dtype=torch.long)
        else:  # the chosen row won (LABEL_A), or the pair is a tie
            batch["labels"] = torch.tensor([LABEL_TIE if ex.label == LABEL_TIE else LABEL_A
                                            for ex in kept], dtype=torch.long)
        return batch


def _as_is(chunk):
    # The default (default_convert) walks every token id of a chunk looking for arrays to convert.
    return chunk


def _ignore_preemption_signals(worker_id: int) -> None:
    # SLURM signals every process of a task. The training process handles the warning (saves and
    # stops); a worker started by spawn/forkserver would otherwise die of it first.
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)


def with_step_counts(batches: Iterator[dict], step_batches: int, epoch_batches: int) -> Iterator[dict]:
    """`batches` with each optimizer step's example count: `step_examples` (a tensor: the
    examples the length policy kept in the step's micro batches, on this rank), `step_index` (the
    batch's place among them), `step_batches` (how many there are) and `epoch_index` (its place in
    the epoch): plain ints, which a trainer reads without waiting for a device.

    A step is `step_batches` consecutive batches of the epoch (its last step may be shorter), as
    Lightning accumulates them; a step's batches are read ahead so that the first one can carry
    the count that the loss of every one is divided by (docs/DESIGN.md section 9).
    """
    pending: list[dict] = []
    for batch in batches:
        pending.append(batch)
        index = int(batch["position"][1])
        if (index + 1) % step_batches and index + 1 < epoch_batches:
            continue
        examples = torch.tensor(sum(len(b["keys"]) for b in pending))
        for i, step_batch in enumerate(pending):
            step_batch.update(step_examples=examples, step_index=i, step_batches=len(pending),
                              epoch_index=int(step_batch["position"][1]))
        yield from pending
        pending = []


class StreamLoader:
    """A DataLoader over a PairStream's encoded chunks, batched by `PairStream.batches`, that knows
    its epoch and position, for mid-epoch resume; each batch carries its optimizer step's example
    count (`with_step_counts`, `step_batches` micro batches a step).

    Workers are re-created each epoch (never persistent) so that each epoch's workers receive the
    current epoch and skip. Lightning saves `state_dict()` in checkpoints and calls
    `load_state_dict()` on resume because this object has both.
    """

    def __init__(self, dataset: PairStream, num_workers: int = 0, step_batches: int = 1):
        self.dataset, self.num_workers, self.step_batches = dataset, num_workers, step_batches
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
        # Batches are formed from whole windows of chunks: let the workers run up to two windows
        # ahead, so that the next window is encoded while this one trains.
        prefetch = None
        if self.num_workers:
            prefetch = math.ceil(2 * self.dataset.cfg.window_batches / self.num_workers)
        loader = DataLoader(self.dataset, batch_size=None, collate_fn=_as_is, num_workers=self.num_workers,
                            prefetch_factor=prefetch, persistent_workers=False,
                            worker_init_fn=_ignore_preemption_signals)
        chunks = iter(loader)
        try:
            steps = len(self.dataset.plan(epoch).sizes)
            for batch in with_step_counts(self.dataset.batches(chunks), self.step_batches, steps):
                self.batches_done += 1
                yield batch
        finally:
            # On an error or an early stop, stop the workers now; left to the garbage collector,
            # each worker's join times out after seconds.
            getattr(chunks, "_shutdown_workers", lambda: None)()
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
