"""Level 1: which source gives the next batch (or sample), given the target shares.

Each selector sees only the active sources (an exhausted source in ``stop="all_exhausted"`` drops
out and the others are renormalised) and is told what each pick delivered, in the mixture's unit
(real tokens by default, so the realized *token* share tracks the target: with sources of very
different lengths, equal sample shares would be far from equal token shares).
"""

from __future__ import annotations

import bisect
from typing import Any, Literal

import numpy as np

from .checkpoint import expect_keys
from .compact import pack_floats, unpack_floats
from .errors import ConfigError
from .world import rng_for

try:
    from . import _loops  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: numpy does the deficit selector's arithmetic
    _loops = None

NATIVE: bool = _loops is not None
"""Whether the deficit selector's per-pick loops run in C (`mixer/_loops.c`); False: numpy."""

SelectorName = Literal["deficit", "random", "round_robin"]
SELECTORS: tuple[str, ...] = ("deficit", "random", "round_robin")


class Deficit:
    """Low-discrepancy selection: pick the source furthest behind its target.

    The target of each source accumulates ``p_i(now) * amount`` as amounts are delivered, so with a
    schedule that moves the target is the integral of the schedule, and ``target - delivered`` sums
    to zero at every step. Picking the largest deficit keeps every source within about one batch of
    its target at all times, instead of the O(sqrt(n)) drift of random picks.
    """

    def __init__(self, num_sources: int) -> None:
        self.target = np.zeros(num_sources)
        self.delivered = np.zeros(num_sources)

    def choose(self, probs: np.ndarray, active: np.ndarray) -> int:
        if NATIVE and (i := _loops.choose(self.target, self.delivered, probs, active)) is not None:
            return i  # the loop below in C (mix="sample" picks once per sample): the same pick
        # A tiny share of p breaks ties (e.g. at the start) in favour of the larger target.
        score = np.where(active & (probs > 0), self.target - self.delivered + 1e-9 * probs, -np.inf)
        return int(np.argmax(score))

    def update(self, source: int, amount: float, probs: np.ndarray) -> None:
        if NATIVE and _loops.update(self.target, self.delivered, probs, source, amount) is not None:
            return  # the same two lines in C, in place: the same bits
        self.target += probs * amount
        self.delivered[source] += amount

    def ahead(self, probs: np.ndarray) -> np.ndarray:
        """About how much must be delivered before each source is picked again: how far it is
        ahead of its target, over its share (the source just picked is the furthest)."""
        return (self.delivered - self.target) / np.maximum(probs, 1e-12)

    def state_dict(self) -> dict[str, Any]:
        # Exact float64 bytes, compressed: a float per source, most of them alike or zero.
        return {"target": pack_floats(self.target), "delivered": pack_floats(self.delivered)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expect_keys("deficit selector", state, ("target", "delivered"))
        n = len(self.target)
        self.target = unpack_floats(state["target"], n, "deficit selector state: 'target'")
        self.delivered = unpack_floats(state["delivered"], n, "deficit selector state: 'delivered'")


class RandomPick:
    """Independent weighted picks from a private generator (cumulative sum + bisect, so the sequence
    does not depend on a library's multinomial implementation).

    To hit the target share of *tokens* (not of picks) in expectation, source ``i`` is picked with
    probability proportional to ``p_i / mean_i``, where ``mean_i`` is the mean amount its picks have
    delivered so far (1 until it has delivered anything).
    """

    def __init__(self, num_sources: int, *, seed: int, stream: tuple[object, ...]) -> None:
        self.rng = rng_for(seed, "select", *stream)
        self.amount = np.zeros(num_sources)
        self.picks = np.zeros(num_sources)

    def choose(self, probs: np.ndarray, active: np.ndarray) -> int:
        mean = np.where(self.picks > 0, self.amount / np.maximum(self.picks, 1), 1.0)
        if np.any(self.picks == 0):
            # Until every source has delivered once, amounts are not comparable: plain p.
            mean = np.ones_like(mean)
        p = np.where(active, probs / mean, 0.0)
        cum = np.cumsum(p).tolist()
        if cum[-1] <= 0:
            return int(np.argmax(active))
        i = bisect.bisect_right(cum, self.rng.random() * cum[-1])
        return min(i, len(cum) - 1)

    def update(self, source: int, amount: float, probs: np.ndarray) -> None:
        self.amount[source] += amount
        self.picks[source] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "amount": pack_floats(self.amount), "picks": pack_floats(self.picks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expect_keys("random selector", state, ("rng", "amount", "picks"))
        self.rng.bit_generator.state = state["rng"]
        n = len(self.amount)
        self.amount = unpack_floats(state["amount"], n, "random selector state: 'amount'")
        self.picks = unpack_floats(state["picks"], n, "random selector state: 'picks'")


class RoundRobin:
    """0, 1, ..., n-1, 0, ... over the active sources with a positive target share."""

    def __init__(self, num_sources: int) -> None:
        self.next = 0

    def choose(self, probs: np.ndarray, active: np.ndarray) -> int:
        n = len(active)
        for k in range(n):
            i = (self.next + k) % n
            if active[i] and probs[i] > 0:
                self.next = (i + 1) % n
                return i
        return int(np.argmax(active))

    def update(self, source: int, amount: float, probs: np.ndarray) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expect_keys("round-robin selector", state, ("next",))
        self.next = int(state["next"])


Selector = Deficit | RandomPick | RoundRobin


def make_selector(name: str, num_sources: int, *, seed: int, stream: tuple[object, ...]) -> Selector:
    if name == "deficit":
        return Deficit(num_sources)
    if name == "random":
        return RandomPick(num_sources, seed=seed, stream=stream)
    if name == "round_robin":
        return RoundRobin(num_sources)
    raise ConfigError(f"selector must be one of {SELECTORS} (got {name!r})")
