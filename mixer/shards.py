"""Which reader reads what: a pure function of (shard list, world, seed, source-epoch).

Every reader computes the same plan independently, so no coordination is needed: within one
source-epoch every sample is read by exactly one of the ``world.readers`` readers.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .world import World, rng_for


class ShardSlice(NamedTuple):
    """Read shard ``shard`` (an index into the source's sorted shard list), keeping the samples whose
    index ``i`` inside the shard satisfies ``i % parts == part``. ``parts > 1`` only when a source has
    fewer shards than there are readers: then several readers share a shard and each reads all of
    its bytes (I/O amplification) but keeps a disjoint subset of its samples."""

    shard: int
    part: int = 0
    parts: int = 1


def shard_order(num_shards: int, *, seed: int, source: str, epoch: int) -> list[int]:
    """The shard order of one source-epoch: a fresh permutation per epoch, the same on every reader."""
    return rng_for(seed, "shard-order", source, epoch).permutation(num_shards).tolist()


def plan(
    num_shards: int,
    world: World,
    *,
    seed: int,
    source: str,
    epoch: int,
    sizes: Sequence[int | None] | None = None,
) -> list[ShardSlice]:
    """This reader's part of one source-epoch, in reading order.

    With at least as many shards as readers, whole shards are assigned: by bytes (greedy
    longest-first onto the least-loaded reader, ties broken by the epoch's shuffled order) when every
    shard size is known, else round-robin over the shuffled order. With fewer shards than readers,
    reader ``r`` reads shard ``order[r % S]`` and keeps every ``parts``-th sample of it.
    """
    if num_shards <= 0:
        return []
    order = shard_order(num_shards, seed=seed, source=source, epoch=epoch)
    readers, me = world.readers, world.reader
    if num_shards < readers:
        shard_pos = me % num_shards
        parts = len(range(shard_pos, readers, num_shards))
        return [ShardSlice(order[shard_pos], me // num_shards, parts)]
    if sizes is None or any(s is None for s in sizes):
        return [ShardSlice(s) for s in order[me::readers]]
    ordered = np.asarray(order, dtype=np.int64)
    mine = ordered[_owners_by_size(ordered, sizes, readers)[ordered] == me]  # in the shuffled order
    return [ShardSlice(s) for s in mine.tolist()]


def _owners_by_size(order: np.ndarray, sizes: Sequence[int | None], readers: int) -> np.ndarray:
    """The reader of every shard under greedy longest-processing-time: shards by decreasing size
    (ties: earlier in ``order`` first), each onto the least-loaded reader (ties: lowest index).

    Every reader computes the whole assignment, so it is kept cheap (1e5 shards over 65,536 readers:
    ~0.1 s, see benchmarks/plan_scale.py): numpy for the sort, and no heap operations for the first
    ``readers`` non-empty shards, which land on readers 0, 1, ... in turn as they would by the heap.
    """
    n = len(order)
    size = np.fromiter((s or 0 for s in sizes), dtype=np.int64, count=n)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    by_size = np.lexsort((rank, -size))
    owner = np.empty(n, dtype=np.int64)
    k = min(readers, int(np.count_nonzero(size)))
    owner[by_size[:k]] = np.arange(k)
    # (load, reader) of every reader; a sorted list is a valid heap
    heap = sorted([*zip(size[by_size[:k]].tolist(), range(k)), *((0, r) for r in range(k, readers))])
    sz = size.tolist()
    rest = by_size[k:].tolist()
    picked = [0] * len(rest)
    replace = heapq.heapreplace
    for j, s in enumerate(rest):
        load, r = heap[0]
        picked[j] = r
        replace(heap, (load + sz[s], r))
    owner[by_size[k:]] = picked
    return owner
