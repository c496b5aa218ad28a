"""Bucket edges, token budgets and the Bucketer."""

import numpy as np
import pytest

from mixer import ConfigError, TokenBudget, bucket_edges
from mixer.bucket import Bucketer


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
        ({"max_tokens": 0}, "max_tokens must be a positive int"),
        ({"max_tokens": 10, "max_length": 11}, "max_length must be in"),
        ({"max_tokens": 10, "multiple_of": 0}, "multiple_of must be >= 1"),
        ({"max_tokens": 10, "overlong": "cut"}, "overlong must be"),
        ({"max_tokens": 10, "buckets": [5, 3]}, "strictly increasing"),
        ({"max_tokens": 10, "buckets": [5, 20]}, "exceeds the longest allowed sample"),
        ({"max_tokens": 10, "max_batch_size": 0}, "max_batch_size must be >= 1"),
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
