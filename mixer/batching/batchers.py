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
from collections.abc import Callable, Iterator, Sequence
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
    ``drain`` yields every batch left at the end of a finite pass. State: see
    :class:`~mixer.state.checkpoint.Rereads` (``load_state_dict``, then ``locations`` and ``attach``)."""

    ready: deque[Any]
    held: int
    count: int
    STATE_DEPTHS: ClassVar[dict[str, int]]

    def add(self, item: T, length: int) -> bool: ...

    def release(self, hold: int, items: int = ..., tokens: int = ...) -> bool: ...

    def drain(self) -> Iterator[list[T]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def locations(self) -> Iterator[Location]: ...

    def attach(self, lookup: Callable[[Location], T]) -> None: ...


def make_batcher(
    edges: Sequence[int], batching: TokenBudget | Packed, *, locate: Callable[[Any], Location] = locate_sample
) -> Batcher[Any]:
    """A :class:`Packer` for :class:`~mixer.Packed`, else a :class:`Bucketer` over ``edges``;
    ``locate(item)`` is where an item lives (its state lists items so)."""
    return Packer(batching, locate=locate) if isinstance(batching, Packed) else Bucketer(edges, batching, locate=locate)


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
    ``drain`` empties the buffers at the end of a finite pass. Items keep arrival order in a bucket.

    ``held`` is what the buffers hold in padded tokens (each item counted at its bucket's edge, an
    upper bound on its length); :meth:`release` caps it, so that a source read rarely does not hold
    (and read ahead) a whole set of nearly full buckets to hand out one batch now and then."""

    def __init__(
        self, edges: Sequence[int], budget: TokenBudget, *, locate: Callable[[T], Location] = locate_sample
    ) -> None:
        self.locate = locate
        self.edges = [int(e) for e in edges]
        self.capacity = [budget.capacity(e) for e in self.edges]
        self.buffers: list[list[T]] = [[] for _ in self.edges]
        self.ready: deque[list[T]] = deque()
        self.max_wait = budget.max_wait if budget.max_wait is not None else 2 * len(self.edges)
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

    def _top_up(self, b: int, floor: float) -> list[tuple[int, int]]:
        """How many items to take from bucket ``b`` and the ones below it, ``[(bucket, count)]``:
        up to ``capacity[b]``, keeping ``real / (count * edges[b]) >= floor`` (at bucket edges)."""
        room, value, n, eb = self.capacity[b], 0, 0, self.edges[b]
        plan = []
        for k in range(b, -1, -1):
            t, ek = min(len(self.buffers[k]), room), self.edges[k]
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


def _rebuilt(cls: type[Bucketer[Any]], fields: dict[str, Any]) -> Bucketer[Any]:
    obj = cls.__new__(cls)
    for name, value in fields.items():
        setattr(obj, name, value)
    return obj
