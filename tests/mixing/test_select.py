"""Level-1 selectors, driven directly with known amounts."""

import numpy as np
import pytest

import mixer.mixing.selector as selector_module
from mixer.mixing.selector import Deficit, RandomPick, RoundRobin


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


@pytest.mark.skipif(not selector_module.NATIVE, reason="the compiled selector loops were not built")
@pytest.mark.parametrize("n", [1, 3, 17, 1000])
def test_compiled_deficit_is_numpys_bit_for_bit(n, monkeypatch):
    """mixer/_select.c against the numpy code it replaces: the same picks and the same state bits
    over a run with moving shares, ties, inactive and zero-share sources and fractional amounts."""
    rng = np.random.default_rng(n)
    fast, slow = Deficit(n), Deficit(n)
    active = np.ones(n, dtype=bool)
    for k in range(3000):
        probs = rng.dirichlet(np.ones(n)) if k % 50 else np.full(n, 1.0 / n)  # equal shares: ties
        if n > 1 and k % 7 == 0:
            probs[rng.integers(n)] = 0.0
            probs /= probs.sum()
        if k == 1500 and n > 2:
            active[: n // 2] = False
        i = fast.choose(probs, active)
        with monkeypatch.context() as m:
            m.setattr(selector_module, "NATIVE", False)
            assert slow.choose(probs, active) == i
            amount = float(rng.integers(1, 70000)) if k % 3 else rng.random() * 1e4
            slow.update(i, amount, probs)
        fast.update(i, amount, probs)
        assert fast.target.tobytes() == slow.target.tobytes()
        assert fast.delivered.tobytes() == slow.delivered.tobytes()
    nobody = np.zeros(n, dtype=bool)
    assert fast.choose(probs, nobody) == 0  # np.argmax of all -inf
    # near-ties, where the 1e-9 * p tie-break decides
    for _ in range(500):
        fast.target, fast.delivered = rng.random(n) * 1e-8, np.zeros(n)
        slow.target, slow.delivered = fast.target.copy(), fast.delivered.copy()
        probs = rng.dirichlet(np.ones(n))
        with monkeypatch.context() as m:
            m.setattr(selector_module, "NATIVE", False)
            expected = slow.choose(probs, active | True)
        assert fast.choose(probs, active | True) == expected


@pytest.mark.skipif(not selector_module.NATIVE, reason="the compiled selector loops were not built")
def test_compiled_deficit_leaves_odd_arrays_to_numpy():
    """Anything but 1-D contiguous float64 (bool for active) of one length: None, numpy decides."""
    from mixer._native import _loops

    t, d = np.zeros(4), np.zeros(4)
    p = np.full(4, 0.25)
    active = np.ones(4, dtype=bool)
    assert _loops.choose(t, d, p, active) == 0
    assert _loops.choose(t, d, p.astype(np.float32), active) is None
    assert _loops.choose(t, d, np.full(8, 0.125)[::2], active) is None
    assert _loops.choose(t, d, p, active.astype(np.int8)) is None
    assert _loops.choose(t, d, p[:3], active) is None
    assert _loops.update(t, d, p, 4, 1.0) is None  # no such source
    assert _loops.update(t, d, p, 1, 2.0) is True and d[1] == 2.0 and t.tolist() == [0.5] * 4
    with pytest.raises(TypeError):
        _loops.update(t, d, p, 1, "x")


def test_the_compiled_selector_is_built_where_the_reader_core_is():
    """Both come from one setup.py and compiler: one built without the other is a build failure
    that `optional=True` would otherwise hide."""
    from mixer.read import tario

    assert (selector_module._loops is None) == (tario._tarwalk is None)


@pytest.mark.skipif(not selector_module.NATIVE, reason="the compiled selector loops were not built")
def test_the_deficit_selector_uses_the_compiled_loops(monkeypatch):
    """The fast path is not silently dead: with NATIVE the numpy code is never reached."""
    sel = Deficit(3)
    monkeypatch.setattr(selector_module, "np", None)  # numpy's path would fail on None.where
    probs, active = np.array([0.5, 0.3, 0.2]), np.ones(3, dtype=bool)
    i = sel.choose(probs, active)
    sel.update(i, 100, probs)
    assert i == 0 and sel.delivered.tolist() == [100.0, 0.0, 0.0]
