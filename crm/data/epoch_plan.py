"""The epoch plan: which records each rank reads and how many batches every rank yields.

Splitting whole shards across ranks cannot give every rank the same number of batches when shards
differ in size, or when there are fewer shards than ranks x workers; unequal batch counts hang the
collectives of DDP/FSDP at the epoch end. So the plan splits the *record sequence* instead: the
epoch's shards (in a seeded order) are concatenated, each rank takes a contiguous range of it
(sizes differ by at most one), and every rank yields the same number K of batches, their sizes
spread evenly. A rank reads only the shards its range touches.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from crm.data.manifest import ShardInfo


@dataclass(frozen=True)
class Segment:
    """Read `shard`, skip its first `skip` eligible records, then take `take`."""

    shard: ShardInfo
    skip: int
    take: int


def shard_order(shards: list[ShardInfo], seed: int, epoch: int, shuffle: bool) -> list[ShardInfo]:
    order = list(shards)
    if shuffle:
        random.Random(f"shards:{seed}:{epoch}").shuffle(order)
    return order


def rank_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous part of `total` records, split evenly over `world` ranks."""
    sizes = even_split(total, world)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def batches_per_rank(total: int, world: int, batch_size: int) -> int:
    """K, the batch count every rank yields; raises when some rank cannot fill K batches."""
    if batch_size < 1:
        raise ValueError(f"batch size {batch_size}: must be at least 1")
    if total < world:
        raise ValueError(f"{total} records cannot give each of {world} ranks a batch: every rank must "
                         "yield the same number of batches or the collectives hang at the epoch end")
    return -(-total // (world * batch_size))  # ceil; then K * batch_size >= every rank's share


def even_split(n: int, parts: int) -> list[int]:
    """`n` items in `parts` sizes that differ by at most one, the larger first."""
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def rank_segments(shards: list[ShardInfo], keep_ties: bool, start: int, stop: int) -> list[Segment]:
    """The pieces of the concatenated eligible-record sequence [start, stop)."""
    segments, offset = [], 0
    for shard in shards:
        n = shard.eligible(keep_ties)
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            segments.append(Segment(shard, lo - offset, hi - lo))
        offset += n
    return segments


@dataclass(frozen=True)
class RankPlan:
    segments: list[Segment]
    sizes: list[int]  # batch sizes, in the order the rank yields its batches

    @property
    def records(self) -> int:
        return sum(self.sizes)


def plan_rank(shards: list[ShardInfo], *, rank: int, world: int, batch_size: int, keep_ties: bool,
              seed: int, epoch: int, shuffle: bool) -> RankPlan:
    total = sum(s.eligible(keep_ties) for s in shards)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    k = batches_per_rank(total, world, batch_size)
    start, stop = rank_range(total, rank, world)
    if total // world < k:
        # Spread thin (e.g. 5 records, 4 ranks, batch 1): some rank would owe an empty batch. Judged
        # by the smallest share (the last rank's), so that every rank refuses, not only that one.
        raise ValueError(f"{total} records over {world} ranks at batch size {batch_size}: rank "
                         f"{world - 1} gets {total // world} records for {k} batches; lower the "
                         "batch size or the number of ranks")
    order = shard_order(shards, seed, epoch, shuffle)
    return RankPlan(rank_segments(order, keep_ties, start, stop), even_split(stop - start, k))
