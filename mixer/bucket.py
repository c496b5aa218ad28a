"""Level 2: length buckets and token-budget batches.

A sample goes to the bucket whose length range holds it; a bucket is full when one more sample could
push ``batch_size * bucket_edge`` past the budget. A batch's padded length is its longest sample, so
the padded size ``B * L`` never exceeds ``max_tokens``.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from .budget import TokenBudget
from .errors import ConfigError

T = TypeVar("T")


def bucket_edges(lengths: Sequence[int] | np.ndarray, *, longest: int, num_buckets: int = 16, max_ratio: float = 1.05) -> list[int]:
    """Bucket upper edges for a length distribution, as a pure function of the sample.

    First ``num_buckets`` ranges of equal token mass (as lhotse does: each bucket then fills at the
    same rate, so none hoards samples), then every range whose longest/shortest ratio exceeds
    ``max_ratio`` is split geometrically, which bounds the padding inside a batch on long-tailed
    lengths where count quantiles waste 15-25%. The last edge is ``longest`` so that every allowed
    sample has a bucket; the range beyond the observed lengths is split the same way.
    """
    lens = np.sort(np.asarray(lengths, dtype=np.int64))
    lens = np.clip(lens[lens > 0], 1, longest)
    if lens.size == 0:
        lens = np.array([longest], dtype=np.int64)
    mass = np.cumsum(lens, dtype=np.float64)
    targets = mass[-1] * np.arange(1, num_buckets) / num_buckets
    cut_idx = np.searchsorted(mass, targets, side="left")
    coarse = sorted(set(lens[cut_idx].tolist()) | {int(lens[-1]), longest})
    fine: list[int] = []
    low = max(int(lens[0]) - 1, 0)
    for high in coarse:
        fine.extend(_geometric_split(low, high, max_ratio))
        low = high
    return _merge_light(fine, lens, min_mass=float(mass[-1]) / (16 * num_buckets))


def _merge_light(fine: list[int], lens: np.ndarray, *, min_mass: float) -> list[int]:
    """Merge neighbouring fine ranges until each holds ``min_mass`` tokens of the sample.

    A range with little mass barely moves overall padding efficiency (which is mass-weighted) but
    holds its samples back for a long time, since it rarely fills a batch. Empty ranges past the
    observed lengths join the last range, whose batches then hold one or two samples each.
    """
    masses = np.diff(np.concatenate([[0.0], np.cumsum(lens, dtype=np.float64)[np.searchsorted(lens, fine, side="right") - 1]]))
    edges: list[int] = []
    acc = 0.0
    for edge, m in zip(fine, masses):
        acc += m
        if acc >= min_mass:
            edges.append(edge)
            acc = 0.0
    if not edges or edges[-1] != fine[-1]:
        edges.append(fine[-1])
    return edges


def _geometric_split(low: int, high: int, max_ratio: float) -> list[int]:
    """Edges in (low, high] such that each range (a, b] has b / (a + 1) <= max_ratio, ending at high."""
    out: list[int] = []
    start = low + 1  # shortest length in the current range
    while start * max_ratio < high:
        edge = max(int(math.floor(start * max_ratio)), start)
        out.append(edge)
        start = edge + 1
    out.append(high)
    return out


class Bucketer(Generic[T]):
    """Per-bucket buffers. ``add`` puts a batch (a list of items) on ``ready`` when the sample's
    bucket is full, and also when the bucket holding the oldest waiting sample has waited while
    ``max_wait`` batches left this bucketer, so a rare length is never held back for long.
    ``drain`` empties the buffers at the end of a finite pass. Items keep arrival order in a bucket.

    ``held`` is what the buffers hold in padded tokens (each item counted at its bucket's edge, an
    upper bound on its length); :meth:`release` caps it, so that a source read rarely does not hold
    (and read ahead) a whole set of nearly full buckets to hand out one batch now and then."""

    def __init__(self, edges: Sequence[int], budget: TokenBudget) -> None:
        self.edges = [int(e) for e in edges]
        self.capacity = [budget.capacity(e) for e in self.edges]
        self.buffers: list[list[T]] = [[] for _ in self.edges]
        self.ready: deque[list[T]] = deque()
        self.max_wait = budget.max_wait if budget.max_wait is not None else 2 * len(self.edges)
        self.emitted = 0  # batches that left the buffers
        # (batches emitted when the bucket's first item arrived, bucket); stale entries are skipped.
        self._waiting: list[tuple[int, int]] = []
        self._since = [0] * len(self.edges)
        self.held = 0

    def add(self, item: T, length: int) -> bool:
        """Buffer ``item``; returns whether a batch is ready."""
        b = bisect.bisect_left(self.edges, length)
        buf = self.buffers[b]
        if not buf:
            self._since[b] = self.emitted
            heapq.heappush(self._waiting, (self.emitted, b))
        buf.append(item)
        self.held += self.edges[b]
        if len(buf) >= self.capacity[b]:
            self._take(b)
        waiting = self._waiting
        while waiting and self.emitted - waiting[0][0] >= self.max_wait:
            since, old = heapq.heappop(waiting)
            if self.buffers[old] and self._since[old] == since:
                self._take(old)
        return bool(self.ready)

    def release(self, hold: int) -> bool:
        """When the buffers hold more than ``hold`` padded tokens and no batch is ready, put the
        largest batch they can make on ``ready``: for some bucket ``b``, up to ``capacity[b]``
        items from ``b`` and then from the buckets below it (shorter samples, padded to ``b``'s
        edge; oldest first), ``b`` chosen for the most real tokens times padding efficiency (both
        estimated at bucket edges; the shortest of equals). Returns whether a batch is ready."""
        if self.held <= hold or self.ready:
            return bool(self.ready)
        best, best_b = -1.0, 0
        for b in range(len(self.buffers)):
            if not self.buffers[b]:
                continue
            room, value = self.capacity[b], 0
            for k in range(b, -1, -1):
                t = min(len(self.buffers[k]), room)
                value += t * self.edges[k]
                room -= t
                if not room:
                    break
            score = value * value / (self.capacity[b] * self.edges[b])  # real tokens x padding efficiency
            if score > best:
                best, best_b = score, b
        batch: list[T] = []
        room = self.capacity[best_b]
        for k in range(best_b, -1, -1):
            buf = self.buffers[k]
            t = min(len(buf), room)
            batch += buf[:t]
            self.buffers[k] = buf[t:]
            self.held -= t * self.edges[k]
            room -= t
            if not room:
                break
        self.ready.append(batch)
        self.emitted += 1
        return True

    def _take(self, b: int) -> None:
        self.held -= len(self.buffers[b]) * self.edges[b]
        self.ready.append(self.buffers[b])
        self.buffers[b] = []
        self.emitted += 1

    def drain(self) -> Iterator[list[T]]:
        """Every batch still ready, then the partial batches left, longest bucket first."""
        while self.ready:
            yield self.ready.popleft()
        for b in reversed(range(len(self.buffers))):
            if self.buffers[b]:
                self._take(b)
                yield self.ready.popleft()

    def __len__(self) -> int:
        return sum(len(b) for b in self.buffers) + sum(len(r) for r in self.ready)

    def state_dict(self, encode: Callable[[T], Any]) -> dict[str, Any]:
        return {
            "buffers": [list(map(encode, buf)) for buf in self.buffers],
            "ready": [list(map(encode, batch)) for batch in self.ready],
            "emitted": self.emitted,
            "since": list(self._since),
            "waiting": [list(w) for w in self._waiting],
        }

    def load_state_dict(self, state: dict[str, Any], decode: Callable[[Any], T]) -> None:
        if len(state["buffers"]) != len(self.edges):
            raise ConfigError(f"bucketer state has {len(state['buffers'])} buckets, this mixture {len(self.edges)}")
        self.buffers = [[decode(x) for x in buf] for buf in state["buffers"]]
        self.held = sum(len(buf) * e for buf, e in zip(self.buffers, self.edges))
        self.ready = deque([decode(x) for x in batch] for batch in state["ready"])
        self.emitted = int(state["emitted"])
        self._since = [int(x) for x in state["since"]]
        self._waiting = [(int(a), int(b)) for a, b in state["waiting"]]
