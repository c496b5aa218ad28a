"""The split plan: within one source-epoch every sample goes to exactly one reader."""

from collections import Counter

import pytest

from mixer.plan.shards import ShardSlice, plan, shard_order
from mixer.plan.world import World


def readers(world_size, num_workers):
    w = max(num_workers, 1)
    return [World(rank=r, world_size=world_size, worker=k, num_workers=w) for r in range(world_size) for k in range(w)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 7, 16])
@pytest.mark.parametrize("epoch", [0, 1])
def test_every_sample_exactly_once(world_size, num_workers, num_shards, epoch):
    samples_in = [3 + (7 * s) % 5 for s in range(num_shards)]  # uneven shards
    seen = Counter()
    for world in readers(world_size, num_workers):
        for sl in plan(num_shards, world, seed=1, source="web", epoch=epoch):
            for i in range(samples_in[sl.shard]):
                if i % sl.parts == sl.part:
                    seen[(sl.shard, i)] += 1
    expected = {(s, i) for s in range(num_shards) for i in range(samples_in[s])}
    assert set(seen) == expected
    assert set(seen.values()) == {1}


def test_fewer_shards_than_readers_split_samples():
    # 2 shards, 5 readers: shard order[0] goes to readers 0, 2, 4 (parts 0, 1, 2 of 3),
    # order[1] to readers 1, 3 (parts 0, 1 of 2).
    order = shard_order(2, seed=0, source="s", epoch=0)
    got = [plan(2, World(rank=r, world_size=5), seed=0, source="s", epoch=0) for r in range(5)]
    assert got[0] == [ShardSlice(order[0], 0, 3)]
    assert got[2] == [ShardSlice(order[0], 1, 3)]
    assert got[4] == [ShardSlice(order[0], 2, 3)]
    assert got[1] == [ShardSlice(order[1], 0, 2)]
    assert got[3] == [ShardSlice(order[1], 1, 2)]


def test_order_is_reshuffled_per_epoch_and_seed():
    a = shard_order(64, seed=0, source="web", epoch=0)
    assert sorted(a) == list(range(64))
    assert a == shard_order(64, seed=0, source="web", epoch=0)
    assert a != shard_order(64, seed=0, source="web", epoch=1)
    assert a != shard_order(64, seed=1, source="web", epoch=0)
    assert a != shard_order(64, seed=0, source="code", epoch=0)


def test_assignment_by_size_balances_bytes():
    sizes = [1000] * 10 + [10] * 100  # a few big shards, many small
    loads = []
    for r in range(5):
        slices = plan(len(sizes), World(rank=r, world_size=5), seed=3, source="s", epoch=0, sizes=sizes)
        loads.append(sum(sizes[sl.shard] for sl in slices))
    assert sum(loads) == sum(sizes)
    assert max(loads) / (sum(loads) / 5) <= 1.05
    # The same shards split by count (sizes unknown) are far less balanced for this seed, so the
    # bound above tells the two splits apart.
    by_count = [
        sum(sizes[sl.shard] for sl in plan(len(sizes), World(rank=r, world_size=5), seed=3, source="s", epoch=0))
        for r in range(5)
    ]
    assert max(by_count) / (sum(by_count) / 5) > 1.2


def test_by_size_keeps_every_shard_once():
    sizes = [(s * 7919) % 1000 + 1 for s in range(1000)]
    seen = Counter()
    for r in range(7):
        for sl in plan(len(sizes), World(rank=r, world_size=7), seed=0, source="x", epoch=2, sizes=sizes):
            seen[sl.shard] += 1
    assert sorted(seen) == list(range(1000)) and set(seen.values()) == {1}
