"""Level-1 selectors, driven directly with known amounts."""

import numpy as np
import pytest

from mixer.selector import Deficit, RandomPick, RoundRobin


def run(selector, probs, amounts, steps):
    delivered = np.zeros(len(probs))
    picks = []
    active = np.ones(len(probs), dtype=bool)
    for k in range(steps):
        i = selector.choose(probs, active)
        amount = amounts[i][k % len(amounts[i])]
        selector.update(i, amount, probs)
        delivered[i] += amount
        picks.append(i)
    return delivered, picks


def test_deficit_tracks_token_share_with_bounded_error():
    probs = np.array([0.6, 0.3, 0.1])
    amounts = [[30000, 34000], [20000, 31000, 26000], [64000]]  # batches of unequal size per source
    sel = Deficit(3)
    delivered = np.zeros(3)
    active = np.ones(3, dtype=bool)
    worst = 0.0
    for k in range(2000):
        i = sel.choose(probs, active)
        a = amounts[i][k % len(amounts[i])]
        sel.update(i, a, probs)
        delivered[i] += a
        # At every point every source is within about one batch of its target.
        worst = max(worst, np.max(np.abs(delivered - probs * delivered.sum())))
    assert worst <= 64000 * 1.01
    assert np.allclose(delivered / delivered.sum(), probs, atol=0.002)


def test_deficit_skips_inactive_and_zero_sources():
    sel = Deficit(3)
    active = np.array([True, False, True])
    probs = np.array([0.0, 0.5, 0.5])
    assert {sel.choose(probs, active) for _ in range(5)} == {2}


def test_random_matches_probabilities_in_expectation_and_is_seeded():
    probs = np.array([0.5, 0.3, 0.2])
    a = RandomPick(3, seed=7, stream=(0, 0))
    _, picks = run(a, probs, [[1], [1], [1]], 20000)
    freq = np.bincount(picks, minlength=3) / len(picks)
    assert np.allclose(freq, probs, atol=0.015)
    _, again = run(RandomPick(3, seed=7, stream=(0, 0)), probs, [[1], [1], [1]], 100)
    _, other = run(RandomPick(3, seed=8, stream=(0, 0)), probs, [[1], [1], [1]], 100)
    assert again == picks[:100] and other != picks[:100]


def test_round_robin_cycles_over_active_sources():
    sel = RoundRobin(3)
    active = np.array([True, True, True])
    probs = np.full(3, 1 / 3)
    assert [sel.choose(probs, active) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    active[1] = False
    assert [sel.choose(probs, active) for _ in range(4)] == [0, 2, 0, 2]


@pytest.mark.parametrize("cls", [Deficit, RoundRobin, lambda n: RandomPick(n, seed=1, stream=(0,))])
def test_state_round_trip(cls):
    probs = np.array([0.5, 0.25, 0.25])
    a = cls(3)
    run(a, probs, [[3], [5], [7]], 17)
    b = cls(3)
    b.load_state_dict(a.state_dict())
    assert run(a, probs, [[3], [5], [7]], 50)[1] == run(b, probs, [[3], [5], [7]], 50)[1]
