"""Level 2 for :class:`~mixer.Packed`: :class:`Packer`, a :class:`~mixer.batching.batchers.Batcher` like the
bucketer, places documents into the rows of up to ``open_batches`` batches (first fit; pieces when
``split_documents``) and hands out :class:`PackedGroup`\\ s, each with its placement. Placement is a
pure function of the order of arrival, so a restored packer continues exactly."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from mixer.errors import SampleError, StateError
from mixer.spec.budget import Packed
from mixer.state.checkpoint import Location, expect_keys, locate_sample

T = TypeVar("T")


class PackedGroup(list[T]):
    """The items of one packed batch, one entry per segment in buffer order (a split document
    appears once per piece), with the placement of each: ``rows``, ``cols`` (start in the row),
    ``starts`` (offset in the document) and ``counts`` (tokens)."""

    __slots__ = ("rows", "cols", "starts", "counts", "row_len", "flat")

    def __init__(
        self,
        items: Sequence[T],
        rows: list[int],
        cols: list[int],
        starts: list[int],
        counts: list[int],
        row_len: int,
        flat: bool,
    ) -> None:
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
    """Level 2 for :class:`~mixer.Packed`, a :class:`~mixer.batching.batchers.Batcher` like
    :class:`~mixer.batching.batchers.Bucketer`: ``add`` places an item's tokens (first fit; pieces when
    splitting) and puts full batches on ``ready`` as :class:`PackedGroup`\\ s; ``drain`` empties
    everything at the end of a finite pass. Placement is a pure function of the order of arrival, so a
    restored packer continues exactly."""

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
        self.held = 0  # tokens placed in the open batches (at most open_batches batches; a buffer budget may cap it)
        self.count = 0  # pieces in the open batches (a split document counts once per piece)
        self._restoring: dict[str, Any] | None = None  # a loaded state waiting for its samples

    def release(self, hold: int, items: int = 1 << 62, tokens: int = 1 << 62) -> bool:
        """Over ``items`` pieces or ``tokens`` tokens and no batch ready: the oldest open batch
        leaves, part-filled (``hold`` is a bucketer's; a packer has no buckets to cap)."""
        if not self.ready and (self.count > items or self.held > tokens) and self.open:
            self._emit(self.open.pop(0))
        return bool(self.ready)

    def close_epoch(self, source: int | None = None) -> bool:
        """A source passed into its next source-epoch: the open batches holding its pieces (all of
        them; with ``source``, those holding a piece of that source's ``(source, sample)`` pairs)
        leave, part-filled, oldest first, so that no document of the next epoch is placed before
        one of this epoch in an earlier batch (at most ``open_batches`` part-filled batches per
        source-epoch). Returns whether a batch is ready."""
        closing = [b for b in self.open if source is None or any(p[0][0] == source for p in b.pieces)]  # type: ignore[index]
        for batch in closing:
            self.open.remove(batch)
            self._emit(batch)
        return bool(self.ready)

    def expire(self) -> bool:
        """(A bucketer's small-source wait bound; a packer's batches leave as they fill.)"""
        return bool(self.ready)

    def add(self, item: T, length: int) -> bool:
        """Place ``item`` (``length`` tokens); returns whether a batch is ready."""
        n = int(length)
        if n <= self.row_len and self._first_fit(item, n):
            return self._flush()
        if not self.split or (n <= self.row_len and len(self.open) < self.max_open):
            if n > self.row_len:
                raise SampleError(
                    f"a document of {n} tokens does not fit in a row of {self.row_len} (Packed(split_documents=False))"
                )
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
        self.held += count
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
        self.held -= self.rows * self.row_len - batch.left
        self.ready.append(self._group(batch.pieces))
        self.emitted += 1

    def _group(self, pieces: list[tuple[T, int, int, int, int]]) -> PackedGroup[T]:
        pieces = sorted(pieces, key=lambda p: (p[1], p[2]))
        return PackedGroup(
            [p[0] for p in pieces],
            [p[1] for p in pieces],
            [p[2] for p in pieces],
            [p[3] for p in pieces],
            [p[4] for p in pieces],
            self.row_len,
            self.flat,
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

    # The fields that list items by location: pieces, each a location and four placement ints.
    LOCATED: ClassVar[tuple[str, ...]] = ("ready", "buffers")

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
                raise StateError(
                    f"packer state places a piece at row {r}, column {c} ({k} tokens): not in {self.rows} rows of "
                    f"{self.row_len}"
                )
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
        self.held = sum(self.rows * self.row_len - b.left for b in self.open)
