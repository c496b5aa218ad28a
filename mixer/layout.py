"""Batch layouts beyond the padded ``[B, L]``: packed sequences, and samples of several named fields.

**Packed** (``Mixture(batching=Packed(...))``): documents back to back, no padding inside a row, with
the boundaries that variable-length attention takes (FlashAttention's ``cu_seqlens`` /
``max_seqlen``) and per-document ``position_ids``. Level 2 is a :class:`Packer` instead of a
:class:`~mixer.bucket.Bucketer`, with the same interface (``add`` → ``ready`` queue, ``drain``,
``state_dict(encode)`` / ``load_state_dict(state, decode)``), so the mixture's exact resume re-reads
the packer's documents by (shard, offset) like it does a bucketer's.

**Fields** (``Mixture(fields={"audio": Field("float32"), "text": Field("int32")})``): ``decode``
returns a mapping of named 1-D arrays; every field is padded to its own length with its own pad
value and dtype, and has a ``<field>_lengths`` tensor. Buckets, budgets and token shares count the
sample's ``length`` (a field's length, e.g. audio samples: ``Source(length="audio")``).

Both batch types are :class:`mixer.Batch` subclasses and share its machinery: ONE flat buffer of the
mixture's int dtype (``pin_memory()`` / ``to()`` move it in one copy, pickling sends it by value or
through a worker's shared slot) and views over it, described by a *spec*: ``(name, dtype, shape)``
regions in order, each starting on an 8-byte boundary, so a region of another dtype (float32 audio in
an int32 buffer, int32 ``cu_seqlens`` in an int64 one) is a reinterpreting view of the same memory.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from .batch import _DTYPES, Batch
from .budget import FIELD_DTYPES as _FIELD_DTYPE_NAMES, Field, Packed, check_fields
from .errors import ConfigError, MixerError, SampleError, StateError

if TYPE_CHECKING:
    from .budget import TokenBudget
    from .mixture import Mixture
    from .stream import Counters

T = TypeVar("T")

#: Field dtypes: what numpy and torch both have (no bfloat16: numpy cannot collate it).
FIELD_DTYPES: dict[str, tuple[Any, torch.dtype]] = {
    "int8": (np.int8, torch.int8),
    "int16": (np.int16, torch.int16),
    "int32": (np.int32, torch.int32),
    "int64": (np.int64, torch.int64),
    "uint8": (np.uint8, torch.uint8),
    "float16": (np.float16, torch.float16),
    "float32": (np.float32, torch.float32),
    "float64": (np.float64, torch.float64),
}
assert tuple(FIELD_DTYPES) == _FIELD_DTYPE_NAMES
_ALIGN = 8  # bytes: every region starts here, so any field dtype can view it

Spec = tuple[tuple[str, str, tuple[int, ...]], ...]


# ---- views over one flat buffer -------------------------------------------------------------


def _extents(spec: Spec, itemsize: int) -> tuple[list[tuple[int, int, int]], int]:
    """Per region (first element, end element, element count of its own dtype) in units of the
    buffer's ``itemsize``; and the buffer's total elements."""
    out = []
    pos = 0  # bytes
    for _, dtype, shape in spec:
        count = math.prod(shape)
        nbytes = -(-count * np.dtype(FIELD_DTYPES[dtype][0]).itemsize // _ALIGN) * _ALIGN
        out.append((pos // itemsize, (pos + nbytes) // itemsize, count))
        pos += nbytes
    return out, pos // itemsize


def _numpy_views(flat: np.ndarray, spec: Spec) -> dict[str, np.ndarray]:
    extents, _ = _extents(spec, flat.itemsize)
    return {
        name: flat[a:b].view(FIELD_DTYPES[dtype][0])[:count].reshape(shape)
        for (name, dtype, shape), (a, b, count) in zip(spec, extents)
    }


def _torch_views(buffer: torch.Tensor, spec: Spec) -> dict[str, torch.Tensor]:
    extents, _ = _extents(spec, buffer.element_size())
    return {
        name: buffer[a:b].view(FIELD_DTYPES[dtype][1])[:count].view(shape)
        for (name, dtype, shape), (a, b, count) in zip(spec, extents)
    }


def _flat_buffer(spec: Spec, dtype: str, out: Callable[[int], np.ndarray | None] | None) -> np.ndarray:
    _, total = _extents(spec, np.dtype(_DTYPES[dtype][0]).itemsize)
    flat = out(total) if out is not None else None
    return flat if flat is not None else np.empty(total, dtype=_DTYPES[dtype][0])


class LayoutBatch(Batch):
    """A :class:`~mixer.Batch` whose views are described by a spec (see the module docstring):
    ``batch[name]`` is the view called ``name``; ``views`` all of them. Pickling, ``pin_memory()``
    and ``to()`` are :class:`~mixer.Batch`'s: one buffer moves, the views are rebuilt."""

    __slots__ = ("spec", "views", "extra")

    def __init__(self, buffer: torch.Tensor, spec: Spec, keys: list[str], info: dict[str, Any] | None = None, extra: tuple[Any, ...] = ()) -> None:
        self.buffer = buffer
        self.slot: tuple[int, int, int, int] | None = None
        self.spec = spec
        self.keys = keys
        self.info = info if info is not None else {}
        self.extra = extra
        self.views = _torch_views(buffer, spec)
        self.lengths = self.views["lengths"]
        self.source = self.views["source"]
        self.batch_size = len(self.lengths)
        self._bind()

    def _bind(self) -> None:
        pass

    def _meta(self) -> tuple[Any, ...]:
        return (self.spec, self.keys, self.info, self.extra)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.views[name]
        except KeyError:
            raise KeyError(f"{type(self).__name__} has no view {name!r} (it has {sorted(self.views)})") from None


class PackedBatch(LayoutBatch):
    """Documents packed back to back (see :class:`Packed`); every field is a view of one buffer.

    * ``tokens [T]``: flat. ``T`` is the real token count (``seq_len=None``: no padding at all) or
      ``rows * seq_len``, each row's tail after its last document filled with ``pad_id``;
      ``rows`` is the ``[rows, seq_len]`` view (``[1, T]`` without rows).
    * ``cu_seqlens [n + 1]`` (int32): where the ``n`` segments (documents, or pieces of a split
      document) start in ``tokens``, then ``T``. A row's padding tail belongs to the segment before
      it, after that document's real tokens (a causal kernel never lets a real token see it).
      ``max_seqlen``: the longest segment (an int, as the kernels take it).
    * ``position_ids [T]``: ``i - cu_seqlens[segment of i]``: restarting at 0 at every segment.
    * ``lengths [n]``: real tokens per segment; ``source [n]``; ``offsets [n]``: where each segment
      starts inside its document (0 unless it continues a split document); ``keys``: per segment.
    """

    __slots__ = ("position_ids", "cu_seqlens", "offsets", "max_seqlen")

    def _bind(self) -> None:
        self.tokens = self.views["tokens"]
        self.position_ids = self.views["position_ids"]
        self.cu_seqlens = self.views["cu_seqlens"]
        self.offsets = self.views["offsets"]
        self.seq_len, self.max_seqlen = self.extra

    @property
    def rows(self) -> torch.Tensor:
        return self.tokens.view(-1, self.seq_len) if self.seq_len else self.tokens.view(1, -1)

    @property
    def padding_efficiency(self) -> float:
        slots = self.tokens.numel()
        return self.num_tokens / slots if slots else 1.0

    def __repr__(self) -> str:
        return (
            f"PackedBatch(T={self.tokens.numel()}, docs={self.batch_size}, max_seqlen={self.max_seqlen}, "
            f"tokens={self.num_tokens}, device={self.buffer.device})"
        )


class FieldBatch(LayoutBatch):
    """Samples of several named fields (see :class:`Field`); every tensor is a view of one buffer.

    ``batch["audio"]`` is ``[B, L_audio]`` padded with that field's pad value, ``batch["audio_lengths"]``
    ``[B]``; the same for every field. ``lengths [B]``: what the budget and the token shares counted
    per sample (its ``length``); ``source [B]``; ``keys``. ``seq_len``: the longest ``length``, so
    ``padding_efficiency`` is that of the counted field, as in the counters.
    """

    __slots__ = ()

    def _bind(self) -> None:
        (self.seq_len,) = self.extra

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(name for name, _, shape in self.spec if len(shape) == 2)

    @property
    def tokens(self) -> torch.Tensor:  # type: ignore[override]
        raise AttributeError(f"FieldBatch has no 'tokens': its fields are batch[name] for name in {self.fields}")

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}={tuple(self.views[n].shape)}" for n in self.fields)
        return f"FieldBatch(B={self.batch_size}, {shapes}, device={self.buffer.device})"


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
    """Level 2 for :class:`Packed`, with :class:`~mixer.bucket.Bucketer`'s interface: ``add`` places
    an item's tokens (first fit; pieces when splitting) and puts full batches on ``ready`` as
    :class:`PackedGroup`\\ s; ``drain`` empties everything at the end of a finite pass. Placement is
    a pure function of the order of arrival, so a restored packer continues exactly."""

    def __init__(self, packed: Packed) -> None:
        self.rows = packed.rows
        self.row_len = packed.row_len
        self.split = packed.split_documents
        self.max_open = packed.open_batches
        self.flat = packed.seq_len is None
        self.open: list[_Open[T]] = []
        self.ready: deque[PackedGroup[T]] = deque()
        self.emitted = 0
        self.held = 0  # never more than open_batches batches: nothing for release() to cap

    def release(self, hold: int) -> bool:
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

    def state_dict(self, encode: Callable[[T], Any]) -> dict[str, Any]:
        """Groups of pieces ``[*encode(item), row, col, start, count]``: ``ready`` (batches) and
        ``buffers`` (open batches), as a Bucketer's state lists its items, so the reader finds the
        samples to re-read the same way."""

        def enc(pieces: Iterator[tuple[T, int, int, int, int]]) -> list[list[Any]]:
            return [[*encode(it), r, c, s, k] for it, r, c, s, k in pieces]

        return {
            "ready": [enc(zip(g, g.rows, g.cols, g.starts, g.counts)) for g in self.ready],
            "buffers": [enc(iter(b.pieces)) for b in self.open],
            "emitted": self.emitted,
        }

    def load_state_dict(self, state: dict[str, Any], decode: Callable[[Any], T]) -> None:
        if "since" in state:
            raise StateError("this is a bucketer's state, not a packer's")

        def dec(p: list[Any]) -> tuple[T, int, int, int, int]:
            r, c, s, k = (int(x) for x in p[-4:])
            if not (0 <= r < self.rows and 0 <= c and c + k <= self.row_len):
                raise StateError(f"packer state places a piece at row {r}, column {c} ({k} tokens): not in {self.rows} rows of {self.row_len}")
            return (decode(p[:-4]), r, c, s, k)

        self.ready = deque(self._group([dec(p) for p in g]) for g in state["ready"])
        self.open = []
        for pieces in state["buffers"]:
            batch: _Open[T] = _Open(self.rows, self.row_len)
            for piece in map(dec, pieces):
                batch.pieces.append(piece)
                batch.free[piece[1]] -= piece[4]
                batch.left -= piece[4]
            self.open.append(batch)
        self.emitted = int(state["emitted"])


class Level2(Protocol[T]):
    """What the reader needs of level 2: :class:`~mixer.bucket.Bucketer` and :class:`Packer`."""

    ready: deque[Any]
    held: int

    def add(self, item: T, length: int) -> bool: ...

    def drain(self) -> Iterator[list[T]]: ...

    def release(self, hold: int) -> bool: ...

    def state_dict(self, encode: Callable[[T], Any]) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], decode: Callable[[Any], T]) -> None: ...


def level2(edges: Sequence[int], batching: TokenBudget | Packed) -> Level2[Any]:
    from .bucket import Bucketer

    return Packer(batching) if isinstance(batching, Packed) else Bucketer(edges, batching)


def unpair(group: list[tuple[int, Any]]) -> tuple[list[Any], np.ndarray]:
    """A group of ``(source, sample)`` pairs (``mix="sample"``) as samples and their sources."""
    samples = [s for _, s in group]
    sources = np.fromiter((j for j, _ in group), dtype=np.int64, count=len(group))
    if isinstance(group, PackedGroup):
        return group.with_items(samples), sources
    return samples, sources


# ---- collates -------------------------------------------------------------------------------


class PackedLayout:
    """What the reader needs for :class:`Packed` batches: accounting and the collate."""

    def __init__(self, packed: Packed, *, dtype: str, pad_id: int) -> None:
        self.packed = packed
        self.dtype = dtype
        self.pad_id = pad_id

    @staticmethod
    def _geometry(group: PackedGroup[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(segment starts in the flat buffer, segment extents, real tokens per segment, T). Rows
        fill from column 0, so each segment runs to the next one's start (or to the end)."""
        count = np.asarray(group.counts, dtype=np.int64)
        pos = np.asarray(group.rows, dtype=np.int64) * group.row_len + np.asarray(group.cols, dtype=np.int64)
        if group.flat:
            total = int(pos[-1] + count[-1]) if len(pos) else 0
        else:
            total = (int(group.rows[-1]) + 1) * group.row_len if len(pos) else 0
        extent = np.diff(pos, append=total)
        return pos, extent, count, total

    def account(self, group: PackedGroup[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per segment: real tokens, documents (1 on a document's first piece), padded slots, and
        split documents (1 on the first piece of a document that was cut)."""
        _, extent, count, _ = self._geometry(group)
        first = np.asarray(group.starts, dtype=np.int64) == 0
        whole = np.fromiter((s.length for s in group), dtype=np.int64, count=len(group))
        return count, first.astype(np.int64), extent, (first & (count < whole)).astype(np.int64)

    def collate(self, group: PackedGroup[Any], sources: np.ndarray, *, info: dict[str, Any], out: Callable[[int], np.ndarray | None] | None = None) -> PackedBatch:
        pos, extent, count, total = self._geometry(group)
        n, dt = len(group), self.dtype
        spec: Spec = (
            ("tokens", dt, (total,)),
            ("position_ids", dt, (total,)),
            ("cu_seqlens", "int32", (n + 1,)),
            ("lengths", dt, (n,)),
            ("source", dt, (n,)),
            ("offsets", dt, (n,)),
        )
        flat = _flat_buffer(spec, dt, out)
        v = _numpy_views(flat, spec)
        v["cu_seqlens"][:n] = pos
        v["cu_seqlens"][n] = total
        positions = v["position_ids"]
        positions[:] = np.arange(total) - np.repeat(pos, extent)
        real = np.concatenate(
            [s.tokens[o : o + k] for s, o, k in zip(group, group.starts, group.counts)] or [np.zeros(0, np.int64)],
            dtype=np.dtype(_DTYPES[dt][0]), casting="unsafe",
        )
        if group.flat:
            v["tokens"][:] = real
        else:
            v["tokens"].fill(self.pad_id)
            v["tokens"][positions < np.repeat(count, extent)] = real
        v["lengths"][:] = count
        v["source"][:] = sources
        v["offsets"][:] = group.starts
        seq_len = group.row_len if not group.flat else total
        max_seqlen = int(extent.max()) if n else 0
        return PackedBatch(torch.from_numpy(flat), spec, [s.key for s in group], info, (seq_len, max_seqlen))

    def max_elements(self, mixture: Mixture) -> int:
        # Each segment holds at least one token (or is a document of none), so n <= T <= max_tokens
        # barring empty documents; an unusual batch beyond the slot travels by value.
        t = self.packed.max_tokens
        spec: Spec = (("a", self.dtype, (t,)), ("b", self.dtype, (t,)), ("c", "int32", (t + 1,))) + tuple(
            (x, self.dtype, (t,)) for x in "def"
        )
        return _extents(spec, np.dtype(_DTYPES[self.dtype][0]).itemsize)[1]


class FieldLayout:
    """What the reader needs for multi-field samples: accounting and the collate."""

    def __init__(self, fields: Mapping[str, Field], *, dtype: str) -> None:
        self.fields = dict(fields)
        self.dtype = dtype

    def account(self, group: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        lengths = np.fromiter((s.length for s in group), dtype=np.int64, count=len(group))
        longest = int(lengths.max()) if len(group) else 0
        ones = np.ones(len(group), dtype=np.int64)
        return lengths, ones, ones * longest, np.zeros(len(group), dtype=np.int64)

    def collate(self, group: Sequence[Any], sources: np.ndarray, *, info: dict[str, Any], out: Callable[[int], np.ndarray | None] | None = None) -> FieldBatch:
        b, dt = len(group), self.dtype
        columns: dict[str, list[np.ndarray]] = {}
        for name in self.fields:
            try:
                columns[name] = [s.tokens[name] for s in group]
            except (KeyError, TypeError, IndexError):
                bad = next(s for s in group if not isinstance(s.tokens, Mapping) or name not in s.tokens)
                got = sorted(bad.tokens) if isinstance(bad.tokens, Mapping) else f"a {type(bad.tokens).__name__}"
                raise SampleError(f"sample {bad.key!r}: decode gave {got}, the mixture's fields need {name!r}") from None
        lens = {name: np.fromiter(map(len, col), dtype=np.int64, count=b) for name, col in columns.items()}
        spec_list: list[tuple[str, str, tuple[int, ...]]] = []
        for name, f in self.fields.items():
            spec_list.append((name, f.dtype, (b, int(lens[name].max()) if b else 0)))
            spec_list.append((f"{name}_lengths", dt, (b,)))
        spec: Spec = (*spec_list, ("lengths", dt, (b,)), ("source", dt, (b,)))
        flat = _flat_buffer(spec, dt, out)
        v = _numpy_views(flat, spec)
        for name, f in self.fields.items():
            grid, n, column = v[name], lens[name], columns[name]
            target = np.dtype(FIELD_DTYPES[f.dtype][0])
            for dtype in {x.dtype for x in column}:
                if not np.can_cast(dtype, target, casting="same_kind"):
                    raise SampleError(f"field {name!r}: cannot cast {dtype} to {target} with casting rule 'same_kind' (Field(dtype={f.dtype!r}))")
            if grid.size > 64 * b:
                # Long rows (audio): a slice copy per row; a concatenate plus a boolean-mask
                # assignment costs ~30x more at a second of audio per row.
                for i, x in enumerate(column):
                    k = len(x)
                    grid[i, :k] = x
                    grid[i, k:] = f.pad
            elif b:
                grid.fill(f.pad)
                grid[np.arange(grid.shape[1]) < n[:, None]] = np.concatenate(column, dtype=target, casting="same_kind")
            v[f"{name}_lengths"][:] = n
        lengths = np.fromiter((s.length for s in group), dtype=np.int64, count=b)
        v["lengths"][:] = lengths
        v["source"][:] = sources
        return FieldBatch(torch.from_numpy(flat), spec, [s.key for s in group], info, (int(lengths.max()) if b else 0,))

    def max_elements(self, mixture: Mixture) -> int:
        """Each field provisioned for ``max_tokens`` elements (true of the counted field; a field
        longer than the counted one, rare, may make a batch travel by value instead of by slot)."""
        budget = mixture.batching
        assert not isinstance(budget, Packed)
        b = max(budget.capacity(e) for edges in mixture.edges for e in edges)
        t, dt = budget.max_tokens, self.dtype
        spec: Spec = tuple(
            x for name, f in self.fields.items() for x in ((name, f.dtype, (t,)), (f"{name}_lengths", dt, (b,)))
        ) + (("lengths", dt, (b,)), ("source", dt, (b,)))
        return _extents(spec, np.dtype(_DTYPES[dt][0]).itemsize)[1]


Layout = PackedLayout | FieldLayout


def make_layout(batching: TokenBudget | Packed, fields: Mapping[str, Field] | None, *, dtype: str, pad_id: int) -> Layout | None:
    """None for the padded token layout (the mixture's own collate)."""
    if isinstance(batching, Packed):
        if fields is not None:
            raise ConfigError("fields: multi-field samples are batched with TokenBudget (padded per field); Packed packs token documents")
        return PackedLayout(batching, dtype=dtype, pad_id=pad_id)
    if fields is not None:
        return FieldLayout(check_fields(fields), dtype=dtype)
    return None


def count(counters: Sequence[Counters], sources: np.ndarray, accounted: tuple[np.ndarray, ...]) -> None:
    """Add one batch to the per-source counters from :meth:`PackedLayout.account` (or Field's)."""
    tokens, docs, slots, split = accounted
    n = len(counters)
    present = np.bincount(sources, minlength=n)
    sums = [np.bincount(sources, weights=x, minlength=n) for x in (tokens, docs, slots, split)]
    for j in np.flatnonzero(present).tolist():
        c = counters[j]
        c.tokens += int(sums[0][j])
        c.samples += int(sums[1][j])
        c.padded += int(sums[2][j])
        c.split += int(sums[3][j])
        c.batches += 1


# ---- decode output --------------------------------------------------------------------------


def decoded_fields(raw: Mapping[str, Any], out: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A decode's mapping checked: named 1-D numeric arrays, in native byte order."""
    where = f"shard {raw.get('__url__', '?')}, key {raw.get('__key__')!r}"
    if not out:
        raise SampleError(f"{where}: decode returned an empty mapping")
    fields: dict[str, np.ndarray] = {}
    for name, value in out.items():
        a = np.asarray(value)
        if a.ndim != 1 or a.dtype.kind not in "iuf":
            raise SampleError(f"{where}: decode field {name!r} must be a 1-D numeric array (got dtype {a.dtype}, shape {a.shape})")
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        fields[name] = a
    return fields


def field_length(raw: Mapping[str, Any], fields: Mapping[str, np.ndarray], name: str | None) -> int:
    """The counted length of a multi-field sample: field ``name``'s, or the first field's."""
    if name is None:
        return len(next(iter(fields.values())))
    try:
        return len(fields[name])
    except KeyError:
        raise SampleError(
            f"shard {raw.get('__url__', '?')}, key {raw.get('__key__')!r}: length={name!r} names no field of the "
            f"decoded sample (fields: {sorted(fields)})"
        ) from None
