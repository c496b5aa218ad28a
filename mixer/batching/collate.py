"""Collates: samples into one flat batch buffer, for the padded, packed and multi-field layouts.

**Padded** (:func:`collate`): tokens ``[B, L]``, ``pad_id`` past each sample's length.

**Packed** (``Mixture(batching=Packed(...))``): documents back to back, no padding inside a row, with
the boundaries that variable-length attention takes (FlashAttention's ``cu_seqlens`` /
``max_seqlen``) and per-document ``position_ids``. Level 2 is a :class:`~mixer.batching.batchers.Packer`
instead of a :class:`~mixer.batching.batchers.Bucketer`.

**Fields** (``Mixture(fields={"audio": Field("float32"), "text": Field("int32")})``): ``decode``
returns a mapping of named 1-D arrays; every field is padded to its own length with its own pad
value and dtype, and has a ``<field>_lengths`` tensor. Buckets, budgets and token shares count the
sample's ``length`` (a field's length, e.g. audio samples: ``Source(length="audio")``).

Every collate writes into ONE buffer: a new array, or the one ``out(num_elements)`` provides (a
worker's shared slot, see :mod:`mixer.runtime.transport`); the batch types are :mod:`mixer.batching.batch`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

from mixer import _native
from mixer.batching.batch import _DTYPES, FIELD_DTYPES, Batch, BatchMeta, FieldBatch, PackedBatch, Spec, _extents
from mixer.batching.batchers import PackedGroup
from mixer.errors import ConfigError, SampleError
from mixer.read.decode import Sample
from mixer.spec.budget import Field, Packed, check_fields
from mixer.spec.dtypes import bfloat16_bits, cast_dtype

if TYPE_CHECKING:
    from mixer.read.counters import Counters
    from mixer.spec.budget import TokenBudget

# the compiled row copies (mixer/_native/_rows.c); None without the compiled cores: numpy copies the rows
_rows = _native.rows

NATIVE: bool = _rows is not None
"""Whether :func:`collate` copies rows with the compiled core by default (True when it was built)."""

#: Where a collate writes: ``out(num_elements)`` gives a writable 1-D array of the batch dtype (a
#: worker's shared slot) or None (a new array is allocated).
Out = Callable[[int], np.ndarray | None]


class Delivered(NamedTuple):
    """What one batch delivers, per item (a sample; a segment of a packed batch), in the fields of
    the per-source counters they are added to (:func:`count_delivered`)."""

    tokens: np.ndarray  # real tokens
    samples: np.ndarray  # 1 on a sample's first (or only) segment
    padded: np.ndarray  # slots taken, padding included
    split: np.ndarray  # 1 on the first piece of a document that was cut


class Layout(Protocol):
    """How a batch is accounted, collated and sized: :class:`PaddedLayout`, :class:`PackedLayout`,
    :class:`FieldLayout` (one per mixture, from :func:`make_layout`). ``group`` is a batch as level
    2 cut it (samples in batch order; a :class:`~mixer.batching.batchers.PackedGroup` for packed batches),
    ``sources`` each sample's source index."""

    def account(self, group: Sequence[Sample]) -> Delivered:
        """What the batch delivers, per item, before it is collated (the selector and the
        counters count it)."""
        ...

    def collate(
        self, group: Sequence[Sample], sources: np.ndarray, *, meta: BatchMeta, out: Out | None = None
    ) -> Batch:
        """The batch in one flat buffer: from ``out`` when it gives one, else a new array."""
        ...

    def max_elements(self, edges: Sequence[Sequence[int]]) -> int:
        """The largest flat buffer a batch can need (the size of a worker's shared slot), given
        every source's bucket edges; a batch beyond it travels by value instead."""
        ...


def collate(
    token_arrays: Sequence[np.ndarray],
    lengths: np.ndarray,
    sources: np.ndarray,
    keys: list[str],
    *,
    pad_id: int = 0,
    dtype: str = "int32",
    meta: BatchMeta | None = None,
    out: Out | None = None,
    native: bool | None = None,
) -> Batch:
    """Pad ``token_arrays`` (already cut to ``lengths``) into one preallocated buffer: a new array,
    or the one ``out(num_elements)`` provides (a worker's shared slot).

    One copy per row into the padded grid: no per-sample tensors and no Python loop over tokens.
    With the compiled row copies (`NATIVE`; ``native=False`` or ``mixer.batching.collate.NATIVE = False``
    turns them off) each row is one ``memcpy`` plus its padding, in C; rows they do not vouch for
    (another array type, a wrong length, ...) go through numpy's slice assignment, the code below,
    which is their oracle: the same tensors and the same errors. Without them, one numpy slice
    assignment per row: a concatenate plus a boolean-mask assignment reads every token twice and
    builds a ``B x L`` mask (~2.0 against ~1.5 CPU-µs per sample at batches of ~120 rows).
    """
    np_dtype, _ = _DTYPES[dtype]
    b = len(token_arrays)
    rows = lengths.tolist()
    seq_len = max(rows) if b else 0
    n = b * seq_len
    flat = out(n + 2 * b) if out is not None else None
    if b and _rows is not None and (NATIVE if native is None else native):
        if flat is None:
            flat = np.empty(n + 2 * b, dtype=np_dtype)  # every slot is written below
        if not _native_rows(
            flat, token_arrays if type(token_arrays) is list else list(token_arrays), rows, seq_len, pad_id
        ):
            _numpy_rows(flat, token_arrays, rows, seq_len, pad_id)
    else:
        if flat is None:
            flat = np.zeros(n + 2 * b, dtype=np_dtype) if pad_id == 0 else np.empty(n + 2 * b, dtype=np_dtype)
            if pad_id != 0:
                flat[:n] = pad_id
        else:
            flat[:n] = pad_id
        _numpy_rows(flat, token_arrays, rows, seq_len, pad_id, padded=True)
    flat[n : n + b] = lengths
    flat[n + b :] = sources
    return Batch(torch.from_numpy(flat), b, seq_len, keys, meta=meta)


def _numpy_rows(
    flat: np.ndarray,
    token_arrays: Sequence[np.ndarray],
    rows: list[int],
    seq_len: int,
    pad_id: int,
    *,
    padded: bool = False,
) -> None:
    """The rows by numpy slice assignment, after ``flat[:B*L] = pad_id`` (unless ``padded``)."""
    if not padded:
        flat[: len(token_arrays) * seq_len] = pad_id
    # setitem casts like concatenate(..., casting="unsafe") did; a row whose array is not its
    # length is a ValueError, as the masked assignment's shape check was.
    start = 0
    for tokens, k in zip(token_arrays, rows):
        flat[start : start + k] = tokens
        start += seq_len


def _native_rows(flat: np.ndarray, arrays: list[np.ndarray], rows: list[int], seq_len: int, pad_id: int) -> bool:
    """The rows by ``_rows.pad`` (see mixer/_native/_rows.c); each row it leaves goes by numpy's slice
    assignment, as in :func:`_numpy_rows` (then its padding), so that row's result or error is
    numpy's. False, with nothing written, for a batch it does not take at all."""
    assert _rows is not None
    pad, b, i = _rows.pad, len(arrays), 0
    while True:
        i = pad(flat, arrays, rows, seq_len, pad_id, i, np.ndarray)
        if i < 0:
            return False
        if i == b:
            return True
        start, k = i * seq_len, rows[i]
        flat[start : start + k] = arrays[i]
        flat[start + k : start + seq_len] = pad_id
        i += 1


def _numpy_views(flat: np.ndarray, spec: Spec) -> dict[str, np.ndarray]:
    extents, _ = _extents(spec, flat.itemsize)
    return {
        name: flat[a:b].view(FIELD_DTYPES[dtype][0])[:count].reshape(shape)
        for (name, dtype, shape), (a, b, count) in zip(spec, extents)
    }


def _flat_buffer(spec: Spec, dtype: str, out: Out | None) -> np.ndarray:
    _, total = _extents(spec, np.dtype(_DTYPES[dtype][0]).itemsize)
    flat = out(total) if out is not None else None
    return flat if flat is not None else np.empty(total, dtype=_DTYPES[dtype][0])


# ---- layouts --------------------------------------------------------------------------------

_LENGTH = operator.attrgetter("length")  # C-level getters: no Python frame per sample
_TOKENS = operator.attrgetter("tokens")
_KEY = operator.attrgetter("key")


def _per_sample(group: Sequence[Sample]) -> Delivered:
    """One row per sample, padded to the longest: the padded and multi-field layouts."""
    lengths = np.fromiter(map(_LENGTH, group), dtype=np.int64, count=len(group))
    ones = np.ones(len(group), dtype=np.int64)
    return Delivered(lengths, ones, ones * (int(lengths.max()) if len(group) else 0), np.zeros_like(ones))


def _most_samples(budget: TokenBudget, edges: Sequence[Sequence[int]]) -> int:
    """The most samples a bucketed batch can hold: the largest capacity of any bucket."""
    return max(budget.capacity(e) for per_source in edges for e in per_source)


class PaddedLayout:
    """Token samples padded to ``[B, L]`` (:func:`collate`), ``L`` the batch's longest sample."""

    def __init__(self, budget: TokenBudget, *, dtype: str, pad_id: int, names: Sequence[str]) -> None:
        self.budget = budget
        self.dtype = dtype
        self.pad_id = pad_id
        self.names = tuple(names)  # the sources', for errors

    def account(self, group: Sequence[Sample]) -> Delivered:
        return _per_sample(group)

    def collate(
        self, group: Sequence[Sample], sources: np.ndarray, *, meta: BatchMeta, out: Out | None = None
    ) -> Batch:
        if group and isinstance(group[0].tokens, dict):
            raise ConfigError(
                f"source {self.names[int(sources[0])]!r}: decode returned fields {sorted(group[0].tokens)}; pass "
                "Mixture(fields={name: mixer.Field(...)}) to collate them"
            )
        # C-level getters: no Python frame per sample.
        lengths = np.fromiter(map(_LENGTH, group), dtype=np.int64, count=len(group))
        return collate(
            list(map(_TOKENS, group)),
            lengths,
            sources,
            list(map(_KEY, group)),
            pad_id=self.pad_id,
            dtype=self.dtype,
            meta=meta,
            out=out,
        )

    def max_elements(self, edges: Sequence[Sequence[int]]) -> int:
        """``B * L <= max_tokens`` plus ``lengths`` and ``source`` (``2 * B``), ``B`` at most the
        largest bucket capacity."""
        return self.budget.max_tokens + 2 * _most_samples(self.budget, edges)


class PackedLayout:
    """Documents packed back to back (:class:`~mixer.PackedBatch`), as a
    :class:`~mixer.batching.batchers.Packer` placed them: its batches are
    :class:`~mixer.batching.batchers.PackedGroup`\\ s."""

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

    def account(self, group: Sequence[Sample]) -> Delivered:
        """Per segment: real tokens, documents (1 on a document's first piece), padded slots, and
        split documents (1 on the first piece of a document that was cut)."""
        assert isinstance(group, PackedGroup)
        _, extent, count, _ = self._geometry(group)
        first = np.asarray(group.starts, dtype=np.int64) == 0
        whole = np.fromiter((s.length for s in group), dtype=np.int64, count=len(group))
        return Delivered(count, first.astype(np.int64), extent, (first & (count < whole)).astype(np.int64))

    def collate(
        self,
        group: Sequence[Sample],
        sources: np.ndarray,
        *,
        meta: BatchMeta,
        out: Out | None = None,
        native: bool | None = None,
    ) -> PackedBatch:
        """``native``: the compiled copies (default `NATIVE`) or numpy's."""
        assert isinstance(group, PackedGroup)
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
        # The compiled copies (see mixer/_native/_rows.c) write tokens and positions straight into place;
        # for any batch they decline, numpy's code below (their oracle) writes both whole.
        if not (
            n
            and _rows is not None
            and (NATIVE if native is None else native)
            and _rows.pack(
                v["tokens"],
                v["position_ids"],
                list(map(_TOKENS, group)),
                group.starts,
                group.counts,
                pos.tolist(),
                extent.tolist(),
                self.pad_id,
                group.flat,
                np.ndarray,
            )
        ):
            positions = v["position_ids"]
            positions[:] = np.arange(total) - np.repeat(pos, extent)
            real = np.concatenate(
                [s.tokens[o : o + k] for s, o, k in zip(group, group.starts, group.counts)] or [np.zeros(0, np.int64)],
                dtype=np.dtype(_DTYPES[dt][0]),
                casting="unsafe",
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
        return PackedBatch(torch.from_numpy(flat), spec, [s.key for s in group], (seq_len, max_seqlen), meta=meta)

    def max_elements(self, edges: Sequence[Sequence[int]]) -> int:
        # Each segment holds at least one token (or is a document of none), so n <= T <= max_tokens
        # barring empty documents; an unusual batch beyond the slot travels by value.
        t = self.packed.max_tokens
        spec: Spec = (("a", self.dtype, (t,)), ("b", self.dtype, (t,)), ("c", "int32", (t + 1,))) + tuple(
            (x, self.dtype, (t,)) for x in "def"
        )
        return _extents(spec, np.dtype(_DTYPES[self.dtype][0]).itemsize)[1]


class FieldLayout:
    """Samples of several named fields (:class:`~mixer.FieldBatch`), each padded on its own; the
    budget and the counters count each sample's ``length``."""

    def __init__(self, fields: Mapping[str, Field], budget: TokenBudget, *, dtype: str) -> None:
        self.fields = dict(fields)
        self.budget = budget
        self.dtype = dtype

    def account(self, group: Sequence[Sample]) -> Delivered:
        return _per_sample(group)

    def collate(
        self, group: Sequence[Sample], sources: np.ndarray, *, meta: BatchMeta, out: Out | None = None
    ) -> FieldBatch:
        b, dt = len(group), self.dtype
        columns: dict[str, list[np.ndarray]] = {}
        for name in self.fields:
            try:
                columns[name] = [s.tokens[name] for s in group]
            except (KeyError, TypeError, IndexError):
                bad = next(s for s in group if not isinstance(s.tokens, Mapping) or name not in s.tokens)
                got = sorted(bad.tokens) if isinstance(bad.tokens, Mapping) else f"a {type(bad.tokens).__name__}"
                raise SampleError(
                    f"sample {bad.key!r}: decode gave {got}, the mixture's fields need {name!r}"
                ) from None
        lens = {name: np.fromiter(map(len, col), dtype=np.int64, count=b) for name, col in columns.items()}
        spec_list: list[tuple[str, str, tuple[int, ...]]] = []
        for name, f in self.fields.items():
            spec_list.append((name, f.dtype, (b, int(lens[name].max()) if b else 0, *f.feature_shape)))
            spec_list.append((f"{name}_lengths", dt, (b,)))
        spec: Spec = (*spec_list, ("lengths", dt, (b,)), ("source", dt, (b,)))
        flat = _flat_buffer(spec, dt, out)
        v = _numpy_views(flat, spec)
        for name, f in self.fields.items():
            _fill_field(v[name], lens[name], _field_column(name, f, columns[name], group), f)
            v[f"{name}_lengths"][:] = lens[name]
        lengths = np.fromiter((s.length for s in group), dtype=np.int64, count=b)
        v["lengths"][:] = lengths
        v["source"][:] = sources
        return FieldBatch(
            torch.from_numpy(flat), spec, [s.key for s in group], (int(lengths.max()) if b else 0,), meta=meta
        )

    def max_elements(self, edges: Sequence[Sequence[int]]) -> int:
        """Each field provisioned for ``max_tokens`` time steps (true of the counted field; a field
        longer than the counted one, rare, may make a batch travel by value instead of by slot)."""
        b = _most_samples(self.budget, edges)
        t, dt = self.budget.max_tokens, self.dtype
        spec: Spec = tuple(
            x
            for name, f in self.fields.items()
            for x in ((name, f.dtype, (t, *f.feature_shape)), (f"{name}_lengths", dt, (b,)))
        ) + (("lengths", dt, (b,)), ("source", dt, (b,)))
        return _extents(spec, np.dtype(_DTYPES[dt][0]).itemsize)[1]


def _field_column(name: str, f: Field, column: list[np.ndarray], group: Sequence[Sample]) -> list[np.ndarray]:
    """A field's arrays checked against its `Field` (shape of a time step, cast rule), as they are
    written: bfloat16 values as their bits."""
    for x, s in zip(column, group):
        if x.shape[1:] != f.feature_shape:
            raise SampleError(
                f"sample {s.key!r}: field {name!r} has shape {x.shape}, the mixture's Field(feature_shape="
                f"{f.feature_shape}) needs [length, {', '.join(map(str, f.feature_shape))}]".replace(", ]", "]")
            )
    target = cast_dtype(f.dtype)
    for dtype in {x.dtype for x in column}:
        if not np.can_cast(dtype, target, casting="same_kind"):
            raise SampleError(
                f"field {name!r}: cannot cast {dtype} to {target} with casting rule 'same_kind' "
                f"(Field(dtype={f.dtype!r}))"
            )
    if f.dtype == "bfloat16":
        return [bfloat16_bits(x) for x in column]
    return column


def _fill_field(grid: np.ndarray, n: np.ndarray, column: list[np.ndarray], f: Field) -> None:
    """``grid[i, :n[i]] = column[i]``, ``f.pad`` after: ``grid`` is ``[B, T_max, *feature_shape]``."""
    pad = bfloat16_bits(np.array(f.pad)).item() if f.dtype == "bfloat16" else f.pad
    b = len(column)
    if grid.size > 64 * b:
        # Long rows (audio): a slice copy per row; a concatenate plus a boolean-mask
        # assignment costs ~30x more at a second of audio per row.
        for i, x in enumerate(column):
            k = len(x)
            grid[i, :k] = x
            grid[i, k:] = pad
    elif b:
        grid.fill(pad)
        grid[np.arange(grid.shape[1]) < n[:, None]] = np.concatenate(column, dtype=grid.dtype, casting="same_kind")


def make_layout(
    batching: TokenBudget | Packed, fields: Mapping[str, Field] | None, *, dtype: str, pad_id: int, names: Sequence[str]
) -> Layout:
    """The mixture's layout: packed for :class:`~mixer.Packed`, multi-field with ``fields``, else
    padded tokens. ``names``: the sources', for errors."""
    if isinstance(batching, Packed):
        if fields is not None:
            raise ConfigError(
                "fields: multi-field samples are batched with TokenBudget (padded per field); Packed packs token "
                "documents"
            )
        return PackedLayout(batching, dtype=dtype, pad_id=pad_id)
    if fields is not None:
        return FieldLayout(check_fields(fields), batching, dtype=dtype)
    return PaddedLayout(batching, dtype=dtype, pad_id=pad_id, names=names)


def count_delivered(counters: Sequence[Counters], sources: np.ndarray, delivered: Delivered) -> None:
    """Add one batch to the per-source counters: what :meth:`Layout.account` gave, summed per
    source; a source with an item in the batch counts the batch."""
    tokens, docs, slots, split = delivered
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
