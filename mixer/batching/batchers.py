"""Level 2: the batchers that group one source's (or, with ``mix="sample"``, every source's)
samples into batches: :class:`Bucketer` (length buckets under a :class:`~mixer.TokenBudget`) and
:class:`Packer` (documents packed into rows, :class:`~mixer.Packed`; in `mixer.batching.packer`), with the same
interface (``add`` → ``ready`` queue, ``release``, ``drain``) and the same state: each is a
:class:`~mixer.state.checkpoint.Rereads` part whose state lists its items by location (``locate(item)``:
``(shard, offset)``, or ``(source, shard, offset)`` in ``mix="sample"``), so the mixture's exact
resume re-reads a packer's documents like it does a bucketer's.

A bucketer's sample goes to the bucket whose length range holds it; a bucket is full when one more
sample could push ``batch_size * bucket_edge`` past the budget. A batch's padded length is its
longest sample, so the padded size ``B * L`` never exceeds ``max_tokens``.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from mixer import _native
from mixer.batching.packer import PackedGroup, Packer  # noqa: F401 (level 2 for Packed; imported from here too)
from mixer.errors import StateError
from mixer.spec.budget import Packed
from mixer.state.checkpoint import Location, expect_keys, locate_sample

if TYPE_CHECKING:
    from mixer.spec.budget import TokenBudget

T = TypeVar("T")

# The least padding efficiency (estimated at bucket edges) of a batch a bucketer releases early
# because a reader's buffer budget caps it (see Bucketer.release): in samples, and in tokens (where
# it binds more often, for many sources of long samples: 0.97 at the edges is ~0.96 padded).
RELEASE_EFFICIENCY = 0.95
TOKEN_RELEASE_EFFICIENCY = 0.97


class Batcher(Protocol[T]):
    """Level 2, as the mixing loops use it (:class:`Bucketer` and :class:`Packer`). Items are
    samples, or ``(source, sample)`` pairs when one batcher serves every source (``mix="sample"``).

    ``ready`` holds the batches that may leave, oldest first (a batch is a list of items); ``held``
    is what the buffers hold in padded tokens, ``count`` how many items (``ready`` aside). ``add``
    buffers an item and says whether a batch is ready; ``release(hold, items, tokens)`` makes one ready
    early when the buffers hold more than ``hold`` or ``tokens`` padded tokens or more than ``items`` items;
    ``drain`` yields every batch left at the end of a finite pass; ``close_epoch(source)`` makes
    ready what it holds of a source (every item, or with ``source`` the pairs of that source) when
    the source passes into its next source-epoch (``stop="never"``). State: see
    :class:`~mixer.state.checkpoint.Rereads` (``load_state_dict``, then ``locations`` and ``attach``)."""

    ready: deque[Any]
    held: int
    count: int
    STATE_DEPTHS: ClassVar[dict[str, int]]

    def add(self, item: T, length: int) -> bool: ...

    def release(self, hold: int, items: int = ..., tokens: int = ...) -> bool: ...

    def close_epoch(self, source: int | None = None) -> bool: ...

    def expire(self) -> bool: ...

    def drain(self) -> Iterator[list[T]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def locations(self) -> Iterator[Location]: ...

    def attach(self, lookup: Callable[[Location], T]) -> None: ...


# A bucket's wait bound, when TokenBudget.max_wait is None and a source's epoch (this reader's part)
# is short: at most this fraction of the epoch in batches (and at most twice the number of buckets,
# the bound for large sources), so that what a small source delivers in a part of its epoch is not
# mostly its long samples (whose buckets fill first) while the short ones wait.
EPOCH_WAIT = 0.25
# The least padding efficiency (estimated at bucket edges, where it is an upper bound) of a batch
# that a small source's wait bound (Bucketer.expire) or the end of a source-epoch (close_epoch) cuts
# from partial buckets: such batches are a small part of a source's tokens, so padding stays near
# that of full buckets while they leave fuller (measured: benchmarks/length_drift.py).
EXPIRE_EFFICIENCY = 0.95


def epoch_wait(buckets: int, epoch_batches: float | None = None) -> int | None:
    """A small source's wait bound (:meth:`Bucketer.expire`) when the budget leaves it to the
    bucketer: :data:`EPOCH_WAIT` of ``epoch_batches`` (a source-epoch of this reader, in full
    batches: its tokens over ``max_tokens``), at least 1; None when that is not under ``max_wait``'s
    default, twice the number of buckets (a large source) or no epoch is given."""
    if epoch_batches is None:
        return None
    wait = max(int(EPOCH_WAIT * epoch_batches), 1)
    return wait if wait < 2 * buckets else None


# The most source-epoch closes per batch a shared bucketer (mix="sample") makes, over its number of
# buckets: each close takes the buckets holding the source out part-filled, so with many sources of
# short epochs closing them all would leave few batches full.
CLOSE_RATE = 0.5


def closing_sources(rates: Sequence[float], buckets: int) -> list[bool]:
    """Which sources a shared bucketer closes at their epochs' ends, given how often each turns
    its epoch (``rates``: source-epochs per batch of the bucketer, 0 for never): the rarest first,
    while together at most :data:`CLOSE_RATE` over ``buckets`` per batch (the others' epochs are
    not closed: a sample of such a source may be delivered again before all of its epoch were)."""
    budget, chosen = CLOSE_RATE / max(buckets, 1), [False] * len(rates)
    for i in sorted(range(len(rates)), key=lambda i: (rates[i], i)):
        if rates[i] > budget:
            break
        budget -= rates[i]
        chosen[i] = True
    return chosen


def make_batcher(
    edges: Sequence[int],
    batching: TokenBudget | Packed,
    *,
    locate: Callable[[Any], Location] = locate_sample,
    epoch_batches: float | None = None,
) -> Batcher[Any]:
    """A :class:`Packer` for :class:`~mixer.Packed`, else a :class:`Bucketer` over ``edges``;
    ``locate(item)`` is where an item lives (its state lists items so); ``epoch_batches``: the
    source-epoch's size in full batches, when one source feeds it (see :func:`epoch_wait`)."""
    if isinstance(batching, Packed):
        return Packer(batching, locate=locate)
    return Bucketer(edges, batching, locate=locate, epoch_batches=epoch_batches)


class _PythonCore:
    """The bucketer's base without the compiled cores: its counters are plain attributes and ``add``
    is ``_py_add``. A class of its own, not ``object``: ``(object, Generic)`` has no consistent MRO."""


_Core: Any = _native.loops.BucketCore if _native.loops is not None else _PythonCore

NATIVE: bool = _Core is not _PythonCore
"""Whether a bucketer's counters and per-sample ``add`` are compiled (`mixer/_native/_loops.c`, ``BucketCore``)."""


class Bucketer(_Core, Generic[T]):  # type: ignore[valid-type,misc]
    """Per-bucket buffers. ``add`` puts a batch (a list of items) on ``ready`` when the sample's
    bucket is full, and also when the bucket holding the oldest waiting sample has waited while
    ``max_wait`` batches left this bucketer, so a rare length is never held back for long.
    ``drain`` empties the buffers at the end of a finite pass, :meth:`close_epoch` at the end of a
    source-epoch (``stop="never"``). Items keep arrival order in a bucket. (``max_wait`` None: see
    :func:`epoch_wait`; ``epoch_batches`` is the source-epoch's size in full batches.)

    ``held`` is what the buffers hold in padded tokens (each item counted at its bucket's edge, an
    upper bound on its length); :meth:`release` caps it, so that a source read rarely does not hold
    (and read ahead) a whole set of nearly full buckets to hand out one batch now and then."""

    def __init__(
        self,
        edges: Sequence[int],
        budget: TokenBudget,
        *,
        locate: Callable[[T], Location] = locate_sample,
        epoch_batches: float | None = None,
    ) -> None:
        self.locate = locate
        self.edges = [int(e) for e in edges]
        self.capacity = [budget.capacity(e) for e in self.edges]
        self.buffers: list[list[T]] = [[] for _ in self.edges]
        self.ready: deque[list[T]] = deque()
        self.max_wait = budget.max_wait if budget.max_wait is not None else 2 * len(self.edges)
        # A small source's wait bound (see expire), when the budget leaves the bound to the bucketer.
        self.epoch_wait = epoch_wait(len(self.edges), epoch_batches) if budget.max_wait is None else None
        self._wait_is_ours = budget.max_wait is None  # (bound_sources: a max_wait given keeps its bound)
        # Items are (source, sample) pairs (a shared bucketer): {source: its wait bound} for the
        # sources with short epochs, epoch_wait the least of them (expire leaves the buckets holding
        # none of their items to fill); None: epoch_wait for every item. Set by bound_sources.
        self.bounded: dict[int, int] | None = None
        self.emitted = 0  # batches that left the buffers
        # (batches emitted when the bucket's first item arrived, bucket); stale entries are skipped.
        self._waiting: list[tuple[int, int]] = []
        # Per bucket: batches emitted when its oldest item arrived.
        self._opened = [0] * len(self.edges)
        self.held = 0
        self.count = 0  # items in the buffers (a reader's buffer budget caps it)
        self._restoring: dict[str, Any] | None = None  # a loaded state waiting for its samples

    def __reduce__(self) -> tuple[Any, ...]:
        # copy and pickle by fields: the compiled base's are not in __dict__
        return (_rebuilt, (type(self), {**self.__dict__, **{k: getattr(self, k) for k in _CORE_FIELDS}}))

    def _py_add(self, item: T, length: int) -> bool:
        """Buffer ``item``; returns whether a batch is ready. (``add``: this, or the same lines in
        C, ``BucketCore.add``, with the counters as C integers; this is its oracle.)"""
        self.count += 1
        b = bisect.bisect_left(self.edges, length)
        buf = self.buffers[b]
        if not buf:
            self._opened[b] = self.emitted
            heapq.heappush(self._waiting, (self.emitted, b))
        buf.append(item)
        self.held += self.edges[b]
        if len(buf) >= self.capacity[b]:
            self._take(b)
        waiting = self._waiting
        while waiting and self.emitted - waiting[0][0] >= self.max_wait:
            opened, old = heapq.heappop(waiting)
            if self.buffers[old] and self._opened[old] == opened:
                self._take(old)
        return bool(self.ready)

    def release(self, hold: int, items: int = 1 << 62, tokens: int = 1 << 62) -> bool:
        """When the buffers hold more than ``hold`` padded tokens (or ``items`` items, or ``tokens``
        padded tokens) and no batch is ready, put the largest batch they can make on ``ready``: for
        some bucket ``b``, up to ``capacity[b]`` items from ``b`` and then from the buckets below it
        (shorter samples, padded to ``b``'s edge; oldest first), ``b`` chosen for the most real
        tokens times padding efficiency (both estimated at bucket edges; the shortest of equals).
        When only ``items`` or ``tokens`` is exceeded (a reader's buffer budget, shared by many
        sources, leaves this one a batch or two, and buckets then rarely fill), the buckets below
        top the batch up only while its estimated padding efficiency stays at least
        :data:`RELEASE_EFFICIENCY` (:data:`TOKEN_RELEASE_EFFICIENCY` for ``tokens``): a smaller
        batch rather than one padded to a longer bucket's edge. Returns whether a batch is ready."""
        held = self.held
        if (held <= hold and self.count <= items and held <= tokens) or self.ready:
            return bool(self.ready)
        if held > hold:
            floor = 0.0
        else:
            floor = RELEASE_EFFICIENCY if self.count > items else TOKEN_RELEASE_EFFICIENCY
        best, best_plan = -1.0, []
        for b in range(len(self.buffers)):
            if not self.buffers[b]:
                continue
            plan = self._top_up(b, floor)
            value = sum(t * self.edges[k] for k, t in plan)
            score = value * value / (self.capacity[b] * self.edges[b])  # real tokens x padding efficiency
            if score > best:
                best, best_plan = score, plan
        batch: list[T] = []
        for k, t in best_plan:
            buf = self.buffers[k]
            batch += buf[:t]
            self.buffers[k] = buf[t:]
            self.held -= t * self.edges[k]
            self.count -= t
        self.ready.append(batch)
        self.emitted += 1
        return True

    def close_epoch(self, source: int | None = None) -> bool:
        """A source passed into its next source-epoch: cut every item it has in the buffers into
        batches on ``ready`` before the new epoch's first item is added, so that no sample of the
        next epoch leaves before all of this one have: all the items, or with ``source`` (items are
        ``(source, sample)`` pairs, one bucketer for every source) the items of every bucket that
        holds one of that source's, the other sources' with them. Cut longest bucket first, each
        batch up to its bucket's capacity, topped up from the buckets below while its estimated
        padding efficiency stays at least :data:`EXPIRE_EFFICIENCY` (as :meth:`release` tops up;
        the shorter ones form batches of their own); handed out in the order that keeps the share
        of the samples delivered closest to the share of the tokens (:func:`_even_order`), so that
        a small source whose whole epoch waited in its buckets does not deliver its long samples
        first. Returns whether a batch is ready."""
        if source is None:
            pending, self.buffers = self.buffers, [[] for _ in self.edges]
            self._waiting = []  # (every bucket is empty: their entries would only be skipped)
        else:  # the buckets holding the source's items leave whole (the others' items with them: fuller batches)
            closing = [any(it[0] == source for it in buf) for buf in self.buffers]  # type: ignore[index]
            pending = [buf if c else [] for buf, c in zip(self.buffers, closing)]
            self.buffers = [[] if c else buf for buf, c in zip(self.buffers, closing)]
        self.count -= sum(map(len, pending))
        self.held -= sum(len(buf) * e for buf, e in zip(pending, self.edges))
        cut: list[tuple[list[T], int]] = []  # (batch, its tokens at the edges)
        b = len(pending) - 1
        while b >= 0:
            if not pending[b]:
                b -= 1
                continue
            batch: list[T] = []
            tokens = 0
            for k, t in self._top_up(b, EXPIRE_EFFICIENCY, pending):
                batch += pending[k][:t]
                pending[k] = pending[k][t:]
                tokens += t * self.edges[k]
            cut.append((batch, tokens))
        for batch in _even_order(cut):
            self.ready.append(batch)
            self.emitted += 1
        return bool(self.ready)

    def bound_sources(self, bounds: Mapping[int, int]) -> None:
        """A shared bucketer (items are ``(source, sample)`` pairs): the buckets holding an item of a
        source in ``bounds`` leave once they have waited that source's bound (:meth:`expire`), the
        others wait to fill. Nothing changes when the budget gave ``max_wait`` (its bound holds for
        every bucket) or ``bounds`` is empty."""
        if self._wait_is_ours and bounds:
            self.bounded = dict(bounds)
            self.epoch_wait = min(self.bounded.values())

    def expire(self) -> bool:
        """When ``epoch_wait`` is set (a small source's wait bound, see :func:`epoch_wait`) and no
        batch is ready: if the bucket holding the oldest waiting item has waited while
        ``epoch_wait`` batches left, put on ``ready`` the batch that takes its items with the most
        real tokens times padding efficiency, from that bucket or one above it, topped up from
        the buckets below while its estimated padding efficiency stays at least
        :data:`EXPIRE_EFFICIENCY` (so that partial buckets leave together rather than one by one).
        With ``bounded`` (a shared bucketer's sources with short epochs and their bounds), the
        oldest bucket holding an item of such a source that has waited its source's bound, the
        buckets holding none being left to fill. Called once per batch the source is asked for
        (``mix="sample"``: each time a batch left; ages move only as batches leave). Returns
        whether a batch is ready."""
        wait = self.epoch_wait
        if wait is None or self.ready:
            return bool(self.ready)
        waiting, buffers, opened = self._waiting, self.buffers, self._opened
        while waiting and (not buffers[waiting[0][1]] or opened[waiting[0][1]] != waiting[0][0]):
            heapq.heappop(waiting)  # stale: the bucket was emptied since
        if not waiting or self.emitted - waiting[0][0] < wait:
            return False
        b = waiting[0][1]
        if (bounded := self.bounded) is not None:  # the oldest bucket holding an item of a source past its bound
            due = (
                c
                for since, c in sorted(waiting)
                if (age := self.emitted - since) >= wait
                and buffers[c]
                and opened[c] == since
                and any(age >= bounded.get(it[0], age + 1) for it in buffers[c])  # type: ignore[index]
            )
            if (found := next(due, None)) is None:
                return False
            b = found
        best, best_plan = -1.0, []
        for c in range(b, len(buffers)):
            if c > b and not buffers[c]:
                continue
            plan = self._top_up(c, EXPIRE_EFFICIENCY)
            if all(k != b for k, _ in plan):
                break
            value = sum(t * self.edges[k] for k, t in plan)
            score = value * value / (self.capacity[c] * self.edges[c])
            if score > best:
                best, best_plan = score, plan
        batch: list[T] = []
        for k, t in best_plan:
            buf = buffers[k]
            batch += buf[:t]
            buffers[k] = buf[t:]
            self.held -= t * self.edges[k]
            self.count -= t
        self.ready.append(batch)
        self.emitted += 1
        return True

    def _top_up(self, b: int, floor: float, buffers: list[list[T]] | None = None) -> list[tuple[int, int]]:
        """How many items to take from bucket ``b`` and the ones below it, ``[(bucket, count)]``:
        up to ``capacity[b]``, keeping ``real / (count * edges[b]) >= floor`` (at bucket edges);
        of ``buffers`` (default: the bucketer's)."""
        buffers = self.buffers if buffers is None else buffers
        room, value, n, eb = self.capacity[b], 0, 0, self.edges[b]
        plan = []
        for k in range(b, -1, -1):
            t, ek = min(len(buffers[k]), room), self.edges[k]
            if ek < floor * eb:  # (value + t ek) / ((n + t) eb) >= floor bounds t
                t = min(t, max(int((value - floor * n * eb) // (floor * eb - ek)), 0))
            if t:
                plan.append((k, t))
                value, n, room = value + t * ek, n + t, room - t
            if not room or ek < floor * eb:
                break
        return plan

    def _take(self, b: int) -> None:
        self.held -= len(self.buffers[b]) * self.edges[b]
        self.count -= len(self.buffers[b])
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

    # How deep each field's lists go (locations are lists of ints), as mixer.state.columns packs them.
    STATE_DEPTHS: ClassVar[dict[str, int]] = {"buckets": 2, "items": 2, "ready": 3, "emitted": 0, "waiting": 2}

    # The fields that list items by location (see unlocated_state).
    LOCATED: ClassVar[tuple[str, ...]] = ("items", "ready")

    def state_dict(self) -> dict[str, Any]:
        """Only the buckets that hold items: ``buckets`` ``[bucket, opened, count]`` and their
        ``items`` one after the other (a reader has a bucketer per source with dozens of buckets,
        nearly all empty; an empty bucket's ``opened`` is never read again)."""
        locate = self.locate
        state = self.unlocated_state()
        state["items"] = list(map(locate, state["items"]))
        state["ready"] = [list(map(locate, batch)) for batch in state["ready"]]
        state["waiting"] = [list(w) for w in state["waiting"]]
        return state

    def unlocated_state(self) -> dict[str, Any]:
        """:meth:`state_dict` with the items themselves where it lists their locations
        (``LOCATED``): a reader's snapshot locates the items of all its batchers at once, a column
        at a time (:func:`mixer.state.checkpoint.pack_located`)."""
        if not self.count:
            buckets: list[list[int]] = []
            items: list[T] = []
        else:
            full = [b for b, buf in enumerate(self.buffers) if buf]
            buckets = [[b, self._opened[b], len(self.buffers[b])] for b in full]
            items = list(chain.from_iterable([self.buffers[b] for b in full]))
        # ``waiting`` as pairs (tuples): packed the same as lists, without a list per entry.
        return {
            "buckets": buckets,
            "items": items,
            "ready": list(self.ready),
            "emitted": self.emitted,
            "waiting": list(self._waiting),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expect_keys("bucketer", state, tuple(self.STATE_DEPTHS))
        buckets = [(int(b), int(o), int(n)) for b, o, n in state["buckets"]]
        if any(not 0 <= b < len(self.edges) for b, _, _ in buckets) or sum(n for _, _, n in buckets) != len(
            state["items"]
        ):
            raise StateError(
                f"bucketer state: 'buckets' {buckets[:3]}... do not fit {len(self.edges)} buckets "
                f"and {len(state['items'])} items"
            )
        self.emitted = int(state["emitted"])
        self._opened = [0] * len(self.edges)
        for b, opened, _ in buckets:
            self._opened[b] = opened
        self._waiting = [(int(a), int(b)) for a, b in state["waiting"]]
        self._restoring = dict(state, buckets=buckets)

    def locations(self) -> Iterator[Location]:
        assert self._restoring is not None
        for group in (*self._restoring["ready"], self._restoring["items"]):
            for loc in group:
                yield tuple(loc)

    def attach(self, lookup: Callable[[Location], T]) -> None:
        state, self._restoring = self._restoring, None
        assert state is not None
        items = iter(state["items"])
        self.buffers = [[] for _ in self.edges]
        for b, _, n in state["buckets"]:
            self.buffers[b] = [lookup(tuple(x)) for _, x in zip(range(n), items)]
        self.held = sum(len(buf) * e for buf, e in zip(self.buffers, self.edges))
        self.count = sum(map(len, self.buffers))
        self.ready = deque([lookup(tuple(x)) for x in batch] for batch in state["ready"])


if not NATIVE:
    Bucketer.add = Bucketer._py_add  # type: ignore[method-assign]
_CORE_FIELDS = ("count", "held", "emitted", "max_wait", "edges", "capacity", "buffers", "ready", "_waiting", "_opened")


def _even_order(batches: list[tuple[list[T], int]]) -> list[list[T]]:
    """``(batch, tokens)`` pairs in the order that keeps, after each batch, the fraction of all
    their items handed out closest to the fraction of all their tokens (ties: the earlier one):
    batches of short samples (many items, few tokens) go between those of long ones, not last."""
    items = sum(len(b) for b, _ in batches)
    tokens = sum(t for _, t in batches) or 1
    left, out, n, t = list(batches), [], 0, 0
    while left:
        j = min(range(len(left)), key=lambda i: abs((n + len(left[i][0])) / items - (t + left[i][1]) / tokens))
        batch, bt = left.pop(j)
        out.append(batch)
        n, t = n + len(batch), t + bt
    return out


def _rebuilt(cls: type[Bucketer[Any]], fields: dict[str, Any]) -> Bucketer[Any]:
    obj = cls.__new__(cls)
    for name, value in fields.items():
        setattr(obj, name, value)
    return obj
