"""Bucket edges, token budgets and the Bucketer."""

import numpy as np
import pytest
from resume_oracle import assert_resumes_exactly

import mixer.batching.batchers as batchers_module
from mixer import ConfigError, TokenBudget
from mixer.batching.batchers import Bucketer
from mixer.plan.edges import bucket_edges


def padding_efficiency(lengths, budget, edges):
    bucketer = Bucketer(edges, budget)
    real = slots = 0
    for n in lengths:
        if bucketer.add(int(n), int(n)):
            full = bucketer.ready.popleft()
            assert len(full) * max(full) <= budget.max_tokens  # never over budget
            real += sum(full)
            slots += len(full) * max(full)
    return real / slots


def test_capacity_respects_budget_batch_cap_and_multiple():
    b = TokenBudget(max_tokens=1000, max_batch_size=64, multiple_of=8)
    assert b.capacity(10) == 64  # 100 fit, capped at 64
    assert b.capacity(30) == 32  # 33 fit, rounded down to a multiple of 8
    assert b.capacity(200) == 5  # fewer than 8 fit: take what fits
    assert b.capacity(1000) == 1


@pytest.mark.parametrize("median,sigma", [(300, 1.0), (40, 1.5), (3000, 0.7)])
def test_automatic_edges_keep_padding_small_on_lognormal_lengths(median, sigma):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(median), sigma, 30000).astype(int), 1, 32768)
    budget = TokenBudget(max_tokens=32768)
    edges = bucket_edges(lengths[:2000], longest=budget.longest)
    assert edges == sorted(set(edges)) and edges[-1] == 32768
    assert padding_efficiency(lengths, budget, edges) >= 0.90
    # Plain count quantiles waste much more on the same data (the reason for mass + ratio edges).
    quantile_edges = sorted(set(np.quantile(lengths[:2000], np.linspace(0, 1, 17)[1:]).astype(int).tolist()) | {32768})
    assert padding_efficiency(lengths, budget, quantile_edges) < padding_efficiency(lengths, budget, edges)


def test_edges_are_a_pure_function():
    lengths = list(range(1, 5000, 7))
    assert bucket_edges(lengths, longest=8192) == bucket_edges(list(reversed(lengths)), longest=8192)


def add(bucketer, n):
    """Add one sample of length n; the batch that became ready, if any."""
    return bucketer.ready.popleft() if bucketer.add(n, n) else None


def test_bucketer_emits_full_buckets_and_drains_the_rest():
    budget = TokenBudget(max_tokens=100)
    bucketer = Bucketer([10, 50, 100], budget)  # capacities 10, 2, 1
    assert bucketer.capacity == [10, 2, 1]
    out = [add(bucketer, n) for n in (5, 30, 40, 99)]
    assert out[:2] == [None, None]
    assert out[2] == [30, 40]
    assert out[3] == [99]
    assert list(bucketer.drain()) == [[5]]
    assert len(bucketer) == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        # The same rule and words as a config file's batching.<key> (mixer._check), prefixed by
        # the class and field instead of the key path.
        ({"max_tokens": 0}, r"^TokenBudget\.max_tokens: must be >= 1, got 0$"),
        ({"max_tokens": 10, "max_length": 11}, r"^TokenBudget\.max_length: must be <= 10, got 11$"),
        ({"max_tokens": 10, "multiple_of": 0}, r"^TokenBudget\.multiple_of: must be >= 1, got 0$"),
        (
            {"max_tokens": 10, "overlong": "cut"},
            r"^TokenBudget\.overlong: must be one of 'truncate', 'drop', got 'cut'$",
        ),
        (
            {"max_tokens": 10, "buckets": [5, 3]},
            r"^TokenBudget\.buckets\[1\]: must be greater than TokenBudget\.buckets\[0\] \(5\), got 3$",
        ),
        ({"max_tokens": 10, "buckets": [5, 20]}, r"^TokenBudget\.buckets\[1\]: must be <= max_tokens \(10\), got 20$"),
        ({"max_tokens": 10, "max_batch_size": 0}, r"^TokenBudget\.max_batch_size: must be >= 1, got 0$"),
        # Accepted from code before (the drift between code and YAML); ConfigErrors now.
        ({"max_tokens": True}, r"^TokenBudget\.max_tokens: must be an integer, got True$"),
        ({"max_tokens": 10, "max_batch_size": 2.5}, r"^TokenBudget\.max_batch_size: must be an integer, got 2\.5$"),
        ({"max_tokens": 10, "multiple_of": 1.5}, r"^TokenBudget\.multiple_of: must be an integer, got 1\.5$"),
        ({"max_tokens": 10, "num_buckets": "3"}, r"^TokenBudget\.num_buckets: must be an integer, got '3'$"),
    ],
)
def test_budget_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TokenBudget(**kwargs)


def test_a_rare_bucket_waits_at_most_max_wait_batches():
    # Invariant: once max_wait batches have left after a sample arrived, its bucket goes out
    # (partial) with the next add, even when every add fills another bucket.
    bucketer = Bucketer([10, 100], TokenBudget(max_tokens=100, max_wait=3))  # capacities 10 and 1
    assert add(bucketer, 5) is None
    assert [add(bucketer, 60) for _ in range(2)] == [[60], [60]]
    assert bucketer.add(60, 60)
    assert list(bucketer.ready) == [[60], [5]]  # the third batch left, then the waiting one
    bucketer.ready.clear()
    assert len(bucketer) == 0


def test_waiting_bucket_released_as_soon_as_it_has_waited():
    bucketer = Bucketer([10, 100], TokenBudget(max_tokens=100, max_wait=2))
    assert add(bucketer, 5) is None
    assert add(bucketer, 60) == [60]
    assert bucketer.add(60, 60)
    assert list(bucketer.ready) == [[60], [5]]  # waited 2 batches: out right after the second


def test_release_caps_what_the_buckets_hold_with_the_best_batch_they_can_make():
    # edges 10, 20, 40 with max_tokens=80: capacities 8, 4, 2; held counts items at their edge
    b = Bucketer([10, 20, 40], TokenBudget(max_tokens=80, max_wait=100))
    for n in (5, 6, 7, 15, 35):
        assert not b.add(n, n)
    assert b.held == 3 * 10 + 20 + 40
    assert not b.release(90) and not b.ready  # not over the cap: nothing leaves
    # Over 80: per top bucket b, up to capacity[b] items from b then the buckets below it, scored by
    # tokens (at edges) x padding efficiency: b0 takes 3 (30 -> 30*30/(8*10) = 11.25), b1 takes
    # 15 then 3 (50 -> 31.25), b2 takes 35 then 15 (60 -> 60*60/(2*40) = 45): b2 wins.
    assert b.release(80)
    assert list(b.ready) == [[35, 15]] and b.buffers == [[5, 6, 7], [], []]
    assert b.held == 30 and b.emitted == 1
    b.ready.clear()
    assert not b.release(30)
    assert b.release(29) and b.ready.popleft() == [5, 6, 7]  # what is left goes as it is
    assert b.held == 0 and not b.ready


def test_release_takes_the_oldest_of_a_lower_bucket_and_restores_held():
    own = lambda x: (x,)  # noqa: E731  an item is its own location in the state
    b = Bucketer([10, 20], TokenBudget(max_tokens=80, max_wait=100), locate=own)  # capacities 8, 4
    for n in (1, 2, 3, 11, 12, 13):
        b.add(n, n)
    # b0 alone: 30 -> 11.25; b1 with room 4: 11, 12, 13 and the oldest of b0 (1): 70 -> 61.25
    assert b.release(80) and b.ready.popleft() == [11, 12, 13, 1]
    assert b.buffers == [[2, 3], []] and b.held == 20
    restored = Bucketer([10, 20], TokenBudget(max_tokens=80, max_wait=100), locate=own)
    restored.load_state_dict(b.state_dict())
    assert sorted(restored.locations()) == [(2,), (3,)]
    restored.attach(lambda loc: loc[0])
    assert restored.held == 20 and restored.buffers == b.buffers


def test_bucketer_state_round_trips_through_locations():
    """The resume oracle on a bucketer alone: its state lists items by location, and a restored
    bucketer (load_state_dict, then attach) cuts the same batches."""
    budget = TokenBudget(max_tokens=120, max_wait=3)
    items = [(f"x{i}", 1 + (13 * i) % 40) for i in range(50)]

    class Fed:
        def __init__(self):
            self.b = Bucketer([10, 20, 40], budget, locate=lambda item: (int(item[1:]),))  # "x7" lives at (7,)
            self.i = 0

        def __iter__(self):
            while True:
                while not (self.b.ready or self.b.release(200)):
                    self.b.add(*items[self.i % len(items)])
                    self.i += 1
                yield self.b.ready.popleft()

        def state_dict(self):
            return {"b": self.b.state_dict(), "i": self.i}

        def load_state_dict(self, state):
            self.b.load_state_dict(state["b"])
            self.b.attach(lambda loc: f"x{loc[0]}")
            self.i = state["i"]

    assert_resumes_exactly(Fed, cuts=[1, 2, 5, 9, 17], window=8)


class _PyBucketer(Bucketer):
    """The same bucketer with the Python add, the compiled one's oracle."""

    add = Bucketer._py_add


def _bucketer_state(b):
    return (
        b.count,
        b.held,
        b.emitted,
        [list(x) for x in b.buffers],
        [list(x) for x in b.ready],
        list(b._waiting),
        list(b._opened),
    )


@pytest.mark.skipif(not batchers_module.NATIVE, reason="the compiled bucketer core was not built")
@pytest.mark.parametrize("max_wait", [None, 1, 3])
def test_compiled_add_is_the_python_add(max_wait):
    """BucketCore.add against Bucketer._py_add: after every add, release and batch taken, the same
    counters, buckets, ready batches, waiting heap and opening marks; the same return values; the
    same error for a length past the last edge."""
    rng = np.random.default_rng(11)
    budget = TokenBudget(4096, max_wait=max_wait)
    edges = bucket_edges(np.clip(rng.lognormal(np.log(60), 0.9, 2000), 1, 4096).astype(int), longest=budget.longest)
    fast, slow = Bucketer(edges, budget), _PyBucketer(edges, budget)
    assert type(fast).add is not Bucketer._py_add
    for k in range(6000):
        n = int(np.clip(rng.lognormal(np.log(60), 0.9), 1, 4096))
        item = ("s", k, n)
        assert fast.add(item, n) == slow.add(item, n)
        if k % 97 == 0:
            assert fast.release(4096 * 3, 50) == slow.release(4096 * 3, 50)
        if k % 5 == 0 and fast.ready:
            assert fast.ready.popleft() == slow.ready.popleft()
        assert _bucketer_state(fast) == _bucketer_state(slow)
    assert list(fast.drain()) == list(slow.drain())
    for b in (fast, slow):
        with pytest.raises(IndexError):
            b.add("too long", edges[-1] + 1)
    assert _bucketer_state(fast) == _bucketer_state(slow)
    state = fast.state_dict()
    assert state == slow.state_dict()


@pytest.mark.skipif(not batchers_module.NATIVE, reason="the compiled bucketer core was not built")
def test_compiled_core_counters_are_ints_and_the_lists_are_checked():
    b = Bucketer([10, 20], TokenBudget(100))
    b.count = 5
    assert b.count == 5 and isinstance(b.held, int)
    b.buffers = "not a list"
    with pytest.raises(TypeError):
        b.add("x", 3)
    # a cycle through the compiled base's lists is found and freed (its traverse and clear)
    import gc
    import weakref

    b = Bucketer([10, 20], TokenBudget(100))
    b.ready.append(b)
    b.buffers[0].append(b)
    alive = weakref.ref(b)
    del b
    gc.collect()
    assert alive() is None
