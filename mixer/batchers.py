"""Level 2: the batchers that group one source's (or, with ``mix="sample"``, every source's)
samples into batches: :class:`Bucketer` (length buckets under a :class:`~mixer.TokenBudget`) and
:class:`Packer` (documents packed into rows, :class:`~mixer.Packed`), with the same interface
(``add`` → ``ready`` queue, ``release``, ``drain``) and the same state: each is a
:class:`~mixer.checkpoint.Rereads` part whose state lists its items by location (``locate(item)``:
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

from .errors import SampleError, StateError
from .budget import Packed
from .checkpoint import Location, expect_keys, locate_sample

if TYPE_CHECKING:
    from .budget import TokenBudget

T = TypeVar("T")

# The least padding efficiency (estimated at bucket edges) of a batch a bucketer releases early
# because a reader's buffer budget caps it (see Bucketer.release).
RELEASE_EFFICIENCY = 0.95


class Batcher(Protocol[T]):
    """Level 2, as the mixing loops use it (:class:`Bucketer` and :class:`Packer`). Items are
    samples, or ``(source, sample)`` pairs when one batcher serves every source (``mix="sample"``).

    ``ready`` holds the batches that may leave, oldest first (a batch is a list of items); ``held``
    is what the buffers hold in padded tokens, ``count`` how many items (``ready`` aside). ``add``
    buffers an item and says whether a batch is ready; ``release(hold, items)`` makes one ready early
    when the buffers hold more than ``hold`` padded tokens or more than ``items`` items;
    ``drain`` yields every batch left at the end of a finite pass. State: see
    :class:`~mixer.checkpoint.Rereads` (``load_state_dict``, then ``locations`` and ``attach``)."""

    ready: deque[Any]
    held: int
    count: int
    STATE_DEPTHS: ClassVar[dict[str, int]]

    def add(self, item: T, length: int) -> bool: ...

    def release(self, hold: int, items: int = ...) -> bool: ...

    def drain(self) -> Iterator[list[T]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def locations(self) -> Iterator[Location]: ...

    def attach(self, lookup: Callable[[Location], T]) -> None: ...


def make_batcher(edges: Sequence[int], batching: TokenBudget | Packed, *, locate: Callable[[Any], Location] = locate_sample) -> Batcher[Any]:
    """A :class:`Packer` for :class:`~mixer.Packed`, else a :class:`Bucketer` over ``edges``;
    ``locate(item)`` is where an item lives (its state lists items so)."""
    return Packer(batching, locate=locate) if isinstance(batching, Packed) else Bucketer(edges, batching, locate=locate)


class Bucketer(Generic[T]):
    """Per-bucket buffers. ``add`` puts a batch (a list of items) on ``ready`` when the sample's
    bucket is full, and also when the bucket holding the oldest waiting sample has waited while
    ``max_wait`` batches left this bucketer, so a rare length is never held back for long.
    ``drain`` empties the buffers at the end of a finite pass. Items keep arrival order in a bucket.

    ``held`` is what the buffers hold in padded tokens (each item counted at its bucket's edge, an
    upper bound on its length); :meth:`release` caps it, so that a source read rarely does not hold
    (and read ahead) a whole set of nearly full buckets to hand out one batch now and then."""

    def __init__(self, edges: Sequence[int], budget: TokenBudget, *, locate: Callable[[T], Location] = locate_sample) -> None:
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

    def add(self, item: T, length: int) -> bool:
        """Buffer ``item``; returns whether a batch is ready."""
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

    def release(self, hold: int, items: int = 1 << 62) -> bool:
        """When the buffers hold more than ``hold`` padded tokens (or ``items`` items) and no batch
        is ready, put the largest batch they can make on ``ready``: for some bucket ``b``, up to
        ``capacity[b]`` items from ``b`` and then from the buckets below it (shorter samples, padded
        to ``b``'s edge; oldest first), ``b`` chosen for the most real tokens times padding
        efficiency (both estimated at bucket edges; the shortest of equals). When only ``items`` is
        exceeded (a reader's buffer budget, shared by many sources, leaves this one a few dozen
        samples, and buckets then rarely fill), the buckets below top the batch up only while its
        estimated padding efficiency stays at least :data:`RELEASE_EFFICIENCY`: a smaller batch
        rather than one padded to a longer bucket's edge. Returns whether a batch is ready."""
        if (self.held <= hold and self.count <= items) or self.ready:
            return bool(self.ready)
        floor = RELEASE_EFFICIENCY if self.held <= hold else 0.0
        best, best_b, best_plan = -1.0, 0, []
        for b in range(len(self.buffers)):
            if not self.buffers[b]:
                continue
            plan = self._top_up(b, floor)
            value = sum(t * self.edges[k] for k, t in plan)
            score = value * value / (self.capacity[b] * self.edges[b])  # real tokens x padding efficiency
            if score > best:
                best, best_b, best_plan = score, b, plan
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

    # How deep each field's lists go (locations are lists of ints), as mixer.compact packs them.
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
        at a time (:func:`mixer.checkpoint.pack_located`)."""
        if not self.count:
            buckets: list[list[int]] = []
            items: list[T] = []
        else:
            full = [b for b, buf in enumerate(self.buffers) if buf]
            buckets = [[b, self._opened[b], len(self.buffers[b])] for b in full]
            items = list(chain.from_iterable([self.buffers[b] for b in full]))
        # ``waiting`` as pairs (tuples): packed the same as lists, without a list per entry.
        return {"buckets": buckets, "items": items, "ready": list(self.ready), "emitted": self.emitted, "waiting": list(self._waiting)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expect_keys("bucketer", state, tuple(self.STATE_DEPTHS))
        buckets = [(int(b), int(o), int(n)) for b, o, n in state["buckets"]]
        if any(not 0 <= b < len(self.edges) for b, _, _ in buckets) or sum(n for _, _, n in buckets) != len(state["items"]):
            raise StateError(f"bucketer state: 'buckets' {buckets[:3]}... do not fit {len(self.edges)} buckets and {len(state['items'])} items")
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


# ---- level 2 for Packed ---------------------------------------------------------------------


class PackedGroup(list[T]):
    """The items of one packed batch, one entry per segment in buffer order (a split document
    appears once per piece), with the placement of each: ``rows``, ``cols`` (start in the row),
    ``starts`` (offset in the document) and ``counts`` (tokens)."""

    __slots__ = ("rows", "cols", "starts", "counts", "row_len", "flat")

    def __init__(self, items: Sequence[T], rows: list[int], cols: list[int], starts: list[int], counts: list[int], row_len: int, flat: bool) -> None:
        super().__init__(items)
        self.rows, self.cols, self.starts, self.counts = rows, cols, starts, counts
        self.row_len, self.flat = row_len, flat

    def with_items(self, items: Sequence[Any]) -> PackedGroup[Any]:
        return PackedGroup(items, self.rows, self.cols, self.starts, self.counts, self.row_len, self.flat)


class _Open(Generic[T]):
    __slots__ = ("free", "left", "pieces")

    def __init__(self, rows: int, row_len: int) -> None:
        self.free = [row_len] * rows
        self.left = rows * row_len
        self.pieces: list[tuple[T, int, int, int, int]] = []  # (item, row, col, start, count)


class Packer(Generic[T]):
    """Level 2 for :class:`~mixer.Packed`, a :class:`Batcher` like :class:`Bucketer`: ``add`` places
    an item's tokens (first fit; pieces when splitting) and puts full batches on ``ready`` as
    :class:`PackedGroup`\\ s; ``drain`` empties everything at the end of a finite pass. Placement is
    a pure function of the order of arrival, so a restored packer continues exactly."""

    def __init__(self, packed: Packed, *, locate: Callable[[T], Location] = locate_sample) -> None:
        self.locate = locate
        self.rows = packed.rows
        self.row_len = packed.row_len
        self.split = packed.split_documents
        self.max_open = packed.open_batches
        self.flat = packed.seq_len is None
        self.open: list[_Open[T]] = []
        self.ready: deque[PackedGroup[T]] = deque()
        self.emitted = 0
        self.held = 0  # never more than open_batches batches: nothing for release() to cap in tokens
        self.count = 0  # pieces in the open batches (a split document counts once per piece)
        self._restoring: dict[str, Any] | None = None  # a loaded state waiting for its samples

    def release(self, hold: int, items: int = 1 << 62) -> bool:
        """Over ``items`` pieces and no batch ready: the oldest open batch leaves, part-filled."""
        if not self.ready and self.count > items and self.open:
            self._emit(self.open.pop(0))
        return bool(self.ready)

    def add(self, item: T, length: int) -> bool:
        """Place ``item`` (``length`` tokens); returns whether a batch is ready."""
        n = int(length)
        if n <= self.row_len and self._first_fit(item, n):
            return self._flush()
        if not self.split or (n <= self.row_len and len(self.open) < self.max_open):
            if n > self.row_len:
                raise SampleError(f"a document of {n} tokens does not fit in a row of {self.row_len} (Packed(split_documents=False))")
            self._place(self._new(), 0, item, 0, n)
        else:
            done = self._fill(item, n)
            while done < n:
                batch = self._new()
                for r in range(self.rows):
                    take = min(self.row_len, n - done)
                    self._place(batch, r, item, done, take)
                    done += take
                    if done == n:
                        break
        return self._flush()

    def _first_fit(self, item: T, n: int) -> bool:
        for batch in self.open:
            if batch.left >= n:
                free = batch.free
                for r in range(self.rows):
                    if free[r] >= n:
                        self._place(batch, r, item, 0, n)
                        return True
        return False

    def _fill(self, item: T, n: int) -> int:
        """Cut ``item`` into the free space of the open rows, oldest first; returns tokens placed."""
        done = 0
        for batch in self.open:
            for r in range(self.rows):
                f = batch.free[r]
                if f:
                    take = min(f, n - done)
                    self._place(batch, r, item, done, take)
                    done += take
                    if done == n:
                        return done
        return done

    def _place(self, batch: _Open[T], row: int, item: T, start: int, count: int) -> None:
        batch.pieces.append((item, row, self.row_len - batch.free[row], start, count))
        self.count += 1
        batch.free[row] -= count
        batch.left -= count

    def _new(self) -> _Open[T]:
        if len(self.open) >= self.max_open:
            self._emit(self.open.pop(0))
        batch: _Open[T] = _Open(self.rows, self.row_len)
        self.open.append(batch)
        return batch

    def _flush(self) -> bool:
        if any(b.left == 0 for b in self.open):
            for b in [b for b in self.open if b.left == 0]:
                self.open.remove(b)
                self._emit(b)
        return bool(self.ready)

    def _emit(self, batch: _Open[T]) -> None:
        self.count -= len(batch.pieces)
        self.ready.append(self._group(batch.pieces))
        self.emitted += 1

    def _group(self, pieces: list[tuple[T, int, int, int, int]]) -> PackedGroup[T]:
        pieces = sorted(pieces, key=lambda p: (p[1], p[2]))
        return PackedGroup(
            [p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces], [p[3] for p in pieces],
            [p[4] for p in pieces], self.row_len, self.flat,
        )

    def drain(self) -> Iterator[PackedGroup[T]]:
        """Every batch still ready, then the partly filled ones, oldest first."""
        while self.ready:
            yield self.ready.popleft()
        while self.open:
            self._emit(self.open.pop(0))
            yield self.ready.popleft()

    def __len__(self) -> int:
        return sum(len(b.pieces) for b in self.open) + sum(len(g) for g in self.ready)

    STATE_DEPTHS: ClassVar[dict[str, int]] = {"ready": 3, "buffers": 3, "emitted": 0}

    def state_dict(self) -> dict[str, Any]:
        """Groups of pieces ``[*locate(item), row, col, start, count]``: ``ready`` (batches) and
        ``buffers`` (open batches), as a Bucketer's state lists its items."""
        locate = self.locate

        def enc(pieces: Iterator[tuple[T, int, int, int, int]]) -> list[list[Any]]:
            return [[*locate(it), r, c, s, k] for it, r, c, s, k in pieces]

        return {
            "ready": [enc(zip(g, g.rows, g.cols, g.starts, g.counts)) for g in self.ready],
            "buffers": [enc(iter(b.pieces)) for b in self.open],
            "emitted": self.emitted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expect_keys("packer", state, tuple(self.STATE_DEPTHS))
        for p in (p for g in (*state["ready"], *state["buffers"]) for p in g):
            r, c, s, k = (int(x) for x in p[-4:])
            if not (0 <= r < self.rows and 0 <= c and c + k <= self.row_len):
                raise StateError(f"packer state places a piece at row {r}, column {c} ({k} tokens): not in {self.rows} rows of {self.row_len}")
        self.emitted = int(state["emitted"])
        self._restoring = state

    def locations(self) -> Iterator[Location]:
        assert self._restoring is not None
        for group in (*self._restoring["ready"], *self._restoring["buffers"]):
            for piece in group:
                yield tuple(piece[:-4])

    def attach(self, lookup: Callable[[Location], T]) -> None:
        state, self._restoring = self._restoring, None
        assert state is not None

        def dec(p: list[Any]) -> tuple[T, int, int, int, int]:
            r, c, s, k = (int(x) for x in p[-4:])
            return (lookup(tuple(p[:-4])), r, c, s, k)

        self.ready = deque(self._group([dec(p) for p in g]) for g in state["ready"])
        self.open = []
        for pieces in state["buffers"]:
            batch: _Open[T] = _Open(self.rows, self.row_len)
            for piece in map(dec, pieces):
                batch.pieces.append(piece)
                batch.free[piece[1]] -= piece[4]
                batch.left -= piece[4]
            self.open.append(batch)
        self.count = sum(len(b.pieces) for b in self.open)
