"""Level 1: which source gives the next batch (or sample), given the target shares.

Every selector follows the :class:`Selector` protocol and is listed once, by name, in
:data:`SELECTORS`: the Mixture's option check, a config file's error text and elastic resume (each
selector merges the old readers' selectors itself, :meth:`Selector.merge`) all read that table, so a
new selector is one class here and one entry in it.

Each selector sees only the active sources (an exhausted source in ``stop="all_exhausted"`` drops
out and the others are renormalised) and is told what each pick delivered, in the mixture's unit
(real tokens by default, so the realized *token* share tracks the target: with sources of very
different lengths, equal sample shares would be far from equal token shares).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from mixer._native import loops as _loops  # None without the compiled cores: numpy does the arithmetic
from mixer.errors import ConfigError
from mixer.plan.world import rng_for
from mixer.state.checkpoint import expect_keys
from mixer.state.columns import pack_floats, unpack_floats

NATIVE: bool = _loops is not None
"""Whether the deficit selector's per-pick loops run in C (`mixer/_native/_loops.c`); False: numpy."""


class Selector(Protocol):
    """Level 1: built per reader as ``cls(num_sources, seed=..., stream=...)`` (``stream`` names the
    reader's place, for a private generator), told what each pick delivered, checkpointed as its own
    small state."""

    #: its name in :data:`SELECTORS` and in a Mixture's ``selector`` option
    name: ClassVar[str]

    def __init__(self, num_sources: int, *, seed: int = 0, stream: tuple[object, ...] = ()) -> None: ...

    def choose(self, probs: np.ndarray, active: np.ndarray) -> int:
        """The source of the next pick, among the ``active`` ones, at target shares ``probs``."""
        ...

    def update(self, source: int, amount: float, probs: np.ndarray) -> None:
        """``source`` delivered ``amount`` (in the mixture's unit) at shares ``probs``."""
        ...

    def merge(self, olds: Sequence[Any], *, weights: Sequence[float], leader: int) -> None:
        """Elastic resume: take over this reader's part of the old readers' selectors (``olds``, all of
        this class): ``weights[k]`` is the part of old reader ``k``'s work this reader takes (each old
        reader's parts sum to 1 over the new readers), ``leader`` the index of the old reader that made
        the most batches. The new readers together must owe what the old ones owed (:mod:`mixer.mixing.elastic`)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Deficit:
    """Low-discrepancy selection: pick the source furthest behind its target.

    The target of each source accumulates ``p_i(now) * amount`` as amounts are delivered, so with a
    schedule that moves the target is the integral of the schedule, and ``target - delivered`` sums
    to zero at every step. Picking the largest deficit keeps every source within about one batch of
    its target at all times, instead of the O(sqrt(n)) drift of random picks.
    """

    name: ClassVar[str] = "deficit"

    def __init__(self, num_sources: int, *, seed: int = 0, stream: tuple[object, ...] = ()) -> None:
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

    def merge(self, olds: Sequence[Deficit], *, weights: Sequence[float], leader: int) -> None:
        """The old readers' targets and deliveries, each weighed by the part of its work this reader
        takes: the sum of ``target - delivered`` over the readers is the whole run's deficit per
        source before and after, and each reader's totals stay on one reader's scale."""
        self.target = sum((w * s.target for s, w in zip(olds, weights)), np.zeros_like(self.target))
        self.delivered = sum((w * s.delivered for s, w in zip(olds, weights)), np.zeros_like(self.delivered))

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

    name: ClassVar[str] = "random"

    def __init__(self, num_sources: int, *, seed: int = 0, stream: tuple[object, ...] = ()) -> None:
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

    def merge(self, olds: Sequence[RandomPick], *, weights: Sequence[float], leader: int) -> None:
        """Amounts and picks weighed as :meth:`Deficit.merge` weighs its totals (the mean amount per
        pick, which weighs the picks, is that of the old readers taken over); the generator stays this
        reader's own."""
        self.amount = sum((w * s.amount for s, w in zip(olds, weights)), np.zeros_like(self.amount))
        self.picks = sum((w * s.picks for s, w in zip(olds, weights)), np.zeros_like(self.picks))

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "amount": pack_floats(self.amount),
            "picks": pack_floats(self.picks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expect_keys("random selector", state, ("rng", "amount", "picks"))
        self.rng.bit_generator.state = state["rng"]
        n = len(self.amount)
        self.amount = unpack_floats(state["amount"], n, "random selector state: 'amount'")
        self.picks = unpack_floats(state["picks"], n, "random selector state: 'picks'")


class RoundRobin:
    """0, 1, ..., n-1, 0, ... over the active sources with a positive target share."""

    name: ClassVar[str] = "round_robin"

    def __init__(self, num_sources: int, *, seed: int = 0, stream: tuple[object, ...] = ()) -> None:
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

    def merge(self, olds: Sequence[RoundRobin], *, weights: Sequence[float], leader: int) -> None:
        """The position of the old reader that made the most batches: the cycle carries on from there."""
        self.next = olds[leader].next

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expect_keys("round-robin selector", state, ("next",))
        self.next = int(state["next"])


#: Every selector by the name a Mixture's ``selector`` option gives: the one list of them.
SELECTORS: dict[str, type[Selector]] = {cls.name: cls for cls in (Deficit, RandomPick, RoundRobin)}


def make_selector(name: str, num_sources: int, *, seed: int, stream: tuple[object, ...]) -> Selector:
    """A fresh selector of this name (the name was checked against :data:`SELECTORS` at the door)."""
    if name not in SELECTORS:
        raise ConfigError(f"selector must be one of {tuple(SELECTORS)} (got {name!r})")
    return SELECTORS[name](num_sources, seed=seed, stream=stream)
