"""The end of a source-epoch in level 2 (``close_epoch``) and a small source's wait bound
(``expire``), against hand-computed batches; the compiled add continues from what they leave."""

from __future__ import annotations

import numpy as np
import pytest

from mixer.batching import batchers as batchers_module
from mixer.batching.batchers import Bucketer, Packer, epoch_wait
from mixer.spec.budget import Packed, TokenBudget


class _PyBucketer(Bucketer):
    add = Bucketer._py_add


def filled(cls, edges, max_tokens, items, **options):
    b = cls(edges, TokenBudget(max_tokens), **options)
    for item, length in items:
        assert not b.add(item, length)
    return b


def test_close_cuts_every_bucket_and_hands_the_batches_out_evenly():
    """Edges 100/200/400 at 800 tokens: capacities 8, 4, 2. One sample of 390, three of 190, five
    of 90: a shorter bucket tops up a longer one only while the batch stays >= 95% efficient at the
    edges (200 in a 400 batch: 50%; 100 in a 200 one: 50%), so three batches. Of 9 items and 1500
    tokens (at the edges), the 200s (3 items, 600 tokens: 1/3 vs 2/5) go first, then the 100s (8/9
    vs 11/15, closer than the 400's 4/9 vs 2/3), then the 400: not the long ones first."""
    items = [("L", 390)] + [(f"m{i}", 190) for i in range(3)] + [(f"s{i}", 90) for i in range(5)]
    b = filled(Bucketer, [100, 200, 400], 800, items)
    emitted = b.emitted
    assert b.close_epoch()
    assert [list(x) for x in b.ready] == [["m0", "m1", "m2"], ["s0", "s1", "s2", "s3", "s4"], ["L"]]
    assert (b.count, b.held, b.emitted, b.buffers, b._waiting) == (0, 0, emitted + 3, [[], [], []], [])


def test_close_tops_up_from_the_bucket_below_while_efficient():
    """Edges 100/104/200 at 832 tokens: capacities 8, 8, 4. Three samples of 102 and six of 95:
    the 104-bucket's batch takes 3 + 5 (800 + 312 of 8 x 104 slots: 96% >= 95%; a sixth, 8
    items already, has no room), the last 95 goes alone."""
    items = [(f"a{i}", 102) for i in range(3)] + [(f"b{i}", 95) for i in range(6)]
    b = filled(Bucketer, [100, 104, 200], 832, items)
    b.close_epoch()
    assert sorted(map(list, b.ready), key=len) == [["b5"], ["a0", "a1", "a2", "b0", "b1", "b2", "b3", "b4"]]
    assert b.count == 0 and b.held == 0


def test_close_of_one_source_takes_the_buckets_that_hold_it_whole():
    """mix="sample": items are (source, sample) pairs; closing source 0 takes every bucket holding
    one of its items, the other source's items in it too; a bucket of source 1 only stays."""
    items = [((0, "x"), 390), ((1, "z"), 190), ((1, "w"), 90), ((0, "v"), 95)]
    b = filled(Bucketer, [100, 200, 400], 800, items)
    b.close_epoch(0)
    assert [list(x) for x in b.ready] == [[(0, "x")], [(1, "w"), (0, "v")]]
    assert b.buffers == [[], [(1, "z")], []] and (b.count, b.held) == (1, 200)
    assert not b.close_epoch(2) or b.ready  # nothing of a source it does not hold
    assert b.buffers == [[], [(1, "z")], []]


@pytest.mark.skipif(not batchers_module.NATIVE, reason="the compiled bucketer core was not built")
def test_the_compiled_add_continues_from_a_close_and_an_expiry_like_the_python_one():
    rng = np.random.default_rng(3)
    edges, budget = [20, 40, 60, 80, 100], TokenBudget(400)
    fast, slow = Bucketer(edges, budget, epoch_batches=16), _PyBucketer(edges, budget, epoch_batches=16)
    assert fast.epoch_wait == slow.epoch_wait == 4
    for k in range(3000):
        n = int(rng.integers(1, 100))
        assert fast.add(k, n) == slow.add(k, n)
        if k % 7 == 0:
            assert fast.expire() == slow.expire()
        if k % 401 == 0:
            assert fast.close_epoch() == slow.close_epoch()
        while fast.ready and k % 3 == 0:
            assert fast.ready.popleft() == slow.ready.popleft()
        assert (fast.count, fast.held, fast.emitted, fast.buffers, list(fast.ready), fast._waiting) == (
            slow.count,
            slow.held,
            slow.emitted,
            slow.buffers,
            list(slow.ready),
            slow._waiting,
        )


def test_the_epoch_wait_is_a_quarter_of_a_small_epoch_and_none_for_large_ones():
    assert epoch_wait(16, None) is None
    assert epoch_wait(16, 40.0) == 10
    assert epoch_wait(16, 2.0) == 1  # at least one batch
    assert epoch_wait(16, 128.0) is None  # not under 2 x buckets: the old bound
    assert Bucketer([10, 20], TokenBudget(100, max_wait=5), epoch_batches=4).epoch_wait is None  # given: kept


def test_expire_takes_the_oldest_bucket_with_its_neighbours():
    """Edges 100/104/108/200 at 832 (capacities 8, 8, 7, 4), epoch_wait 2: two samples of 100 wait;
    after two batches of 190 leave, expire makes one batch of the two 100s together with the 104s
    and the 108 above them (to the 108 edge: 1 + 2 + 2 items, 516 of 540 slots at the edges, 95.6% >= 95%:
    more real tokens times efficiency than the 100s alone or with the 104s)."""
    b = Bucketer([100, 104, 108, 200], TokenBudget(832), epoch_batches=8)
    assert b.epoch_wait == 2
    for item, n in [("s0", 99), ("s1", 98), ("m0", 103), ("m1", 102), ("h0", 107)]:
        assert not b.add(item, n)
    assert not b.expire()  # nothing has waited yet
    for k in range(8):
        b.add(f"L{k}", 190)
    assert len(b.ready) == 2 and b.expire() and len(b.ready) == 2  # (batches are ready: nothing to do)
    b.ready.clear()
    assert b.expire()
    assert list(b.ready[0]) == ["h0", "m0", "m1", "s0", "s1"]
    b.ready.clear()
    assert b.count == 0 and not b.expire()


def test_a_packer_closes_the_open_batches_of_the_source():
    p = Packer(Packed(max_tokens=40, seq_len=10, open_batches=2))  # 4 rows of 10
    for i, n in enumerate([6, 6, 6, 6, 6]):  # four rows of batch 1 (6 each), the fifth opens batch 2
        p.add(f"d{i}", n)
    assert not p.ready and len(p.open) == 2
    assert p.close_epoch()
    assert [list(g) for g in p.ready] == [["d0", "d1", "d2", "d3"], ["d4"]]
    assert p.open == [] and p.count == 0 and p.held == 0 and not p.expire() or p.ready

    shared = Packer(Packed(max_tokens=40, seq_len=10, open_batches=2))
    for i, n in enumerate([6, 6, 6, 6, 6]):
        shared.add((i % 2, f"d{i}"), n)  # batch 1: sources 0, 1, 0, 1; batch 2: source 0
    shared.add((1, "e"), 6)  # batch 2: sources 0, 1
    shared.close_epoch(1)
    assert len(shared.ready) == 2 and shared.open == []
    shared = Packer(Packed(max_tokens=40, seq_len=10, open_batches=2))
    shared.add((0, "a"), 6)
    shared.close_epoch(1)  # holds nothing of source 1: nothing leaves
    assert not shared.ready and len(shared.open) == 1


def test_a_shared_bucketer_closes_the_epochs_of_its_rarest_sources_within_a_rate():
    """At most CLOSE_RATE / buckets closes per batch in all (here 0.5 / 10 = 0.05), the rarest
    first: 0, 0.01, 0.015 and 0.02 make 0.045, and 0.3 is too many; with 0.025 in place of 0.015,
    0.01 + 0.02 leave 0.02, too little for it. Sources that never turn (rate 0) always close."""
    assert batchers_module.CLOSE_RATE == 0.5
    assert batchers_module.closing_sources([0.02, 0.3, 0.01, 0.0, 0.015], 10) == [True, False, True, True, True]
    assert batchers_module.closing_sources([0.02, 0.3, 0.01, 0.0, 0.025], 10) == [True, False, True, True, False]
    assert batchers_module.closing_sources([1.0], 10) == [False]
