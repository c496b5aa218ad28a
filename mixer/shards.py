"""Which reader reads what: a pure function of (shard list, world, seed, source-epoch).

Every reader computes the same plan independently, so no coordination is needed: within one
source-epoch every sample is read by exactly one of the ``world.readers`` readers.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

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
    return [ShardSlice(s) for s in _by_size(order, sizes, readers)[me]]


def _by_size(order: list[int], sizes: Sequence[int | None], readers: int) -> list[list[int]]:
    """Greedy longest-processing-time assignment; each reader's shards stay in the shuffled order."""
    rank_in_order = {s: i for i, s in enumerate(order)}
    by_size = sorted(order, key=lambda s: (-(sizes[s] or 0), rank_in_order[s]))
    heap = [(0, r) for r in range(readers)]
    assigned: list[list[int]] = [[] for _ in range(readers)]
    for s in by_size:
        load, r = heapq.heappop(heap)
        assigned[r].append(s)
        heapq.heappush(heap, (load + (sizes[s] or 0), r))
    for shards in assigned:
        shards.sort(key=rank_in_order.__getitem__)
    return assigned
