"""Collates: samples into one flat batch buffer, for the padded, packed and multi-field layouts.

**Padded** (:func:`collate`): tokens ``[B, L]``, ``pad_id`` past each sample's length.

**Packed** (``Mixture(batching=Packed(...))``): documents back to back, no padding inside a row, with
the boundaries that variable-length attention takes (FlashAttention's ``cu_seqlens`` /
``max_seqlen``) and per-document ``position_ids``. Level 2 is a :class:`~mixer.batchers.Packer`
instead of a :class:`~mixer.batchers.Bucketer`.

**Fields** (``Mixture(fields={"audio": Field("float32"), "text": Field("int32")})``): ``decode``
returns a mapping of named 1-D arrays; every field is padded to its own length with its own pad
value and dtype, and has a ``<field>_lengths`` tensor. Buckets, budgets and token shares count the
sample's ``length`` (a field's length, e.g. audio samples: ``Source(length="audio")``).

Every collate writes into ONE buffer: a new array, or the one ``out(num_elements)`` provides (a
worker's shared slot, see :mod:`mixer.transport`); the batch types are :mod:`mixer.batch`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .batch import _DTYPES, FIELD_DTYPES, Batch, FieldBatch, PackedBatch, Spec, _extents
from .errors import ConfigError, SampleError
from .layout import Field, Packed, check_fields

if TYPE_CHECKING:
    from .batchers import PackedGroup
    from .bucket import TokenBudget
    from .mixture import Mixture
    from .source import Counters



def collate(
    token_arrays: Sequence[np.ndarray],
    lengths: np.ndarray,
    sources: np.ndarray,
    keys: list[str],
    *,
    pad_id: int = 0,
    dtype: str = "int32",
    info: dict[str, Any] | None = None,
    out: Callable[[int], np.ndarray | None] | None = None,
) -> Batch:
    """Pad ``token_arrays`` (already cut to ``lengths``) into one preallocated buffer: a new array,
    or the one ``out(num_elements)`` provides (a worker's shared slot).

    One concatenate and one masked assignment place every token: no per-sample tensors and no Python
    loop over tokens.
    """
    np_dtype, _ = _DTYPES[dtype]
    b = len(token_arrays)
    seq_len = int(lengths.max()) if b else 0
    n = b * seq_len
    flat = out(n + 2 * b) if out is not None else None
    if flat is None:
        flat = np.empty(n + 2 * b, dtype=np_dtype)
    grid = flat[:n].reshape(b, seq_len)
    grid.fill(pad_id)
    if b:
        mask = np.arange(seq_len) < lengths[:, None]
        grid[mask] = np.concatenate(token_arrays, dtype=np_dtype, casting="unsafe")
    flat[n : n + b] = lengths
    flat[n + b :] = sources
    return Batch(torch.from_numpy(flat), b, seq_len, keys, info)


def _numpy_views(flat: np.ndarray, spec: Spec) -> dict[str, np.ndarray]:
    extents, _ = _extents(spec, flat.itemsize)
    return {
        name: flat[a:b].view(FIELD_DTYPES[dtype][0])[:count].reshape(shape)
        for (name, dtype, shape), (a, b, count) in zip(spec, extents)
    }


def _flat_buffer(spec: Spec, dtype: str, out: Callable[[int], np.ndarray | None] | None) -> np.ndarray:
    _, total = _extents(spec, np.dtype(_DTYPES[dtype][0]).itemsize)
    flat = out(total) if out is not None else None
    return flat if flat is not None else np.empty(total, dtype=_DTYPES[dtype][0])


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


def count_delivered(counters: Sequence[Counters], sources: np.ndarray, accounted: tuple[np.ndarray, ...]) -> None:
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
