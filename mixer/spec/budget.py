"""How batches are sized (:class:`TokenBudget`, :class:`Packed`) and how a field of a multi-field
sample is collated (:class:`Field`): frozen, I/O-free configuration, checked when constructed (the
same rules and messages as a config file; see :mod:`mixer._check`). The machinery that uses them is
in :mod:`mixer.batching.batchers` and :mod:`mixer.batching.collate`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

import numpy as np

from mixer import _check
from mixer.errors import ConfigError
from mixer.spec.dtypes import FIELD_DTYPES as _FIELD_STORAGE

OVERLONG = ("truncate", "drop")
#: Field dtype names (see mixer.spec.dtypes.FIELD_DTYPES).
FIELD_DTYPES = tuple(_FIELD_STORAGE)
RESERVED_FIELDS = ("source", "lengths")  # views every multi-field batch has (as has <field>_lengths)


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # a frozen dataclass normalising its own field


class _Described:
    """Configuration that decides the stream: every field counts in the mixture's fingerprint."""

    def describe(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **vars(self)}


@dataclass(frozen=True)
class TokenBudget(_Described):
    """Batches whose padded size ``B * L`` stays within ``max_tokens``.

    ``buckets``: explicit, increasing bucket upper edges (lengths); None derives them from a warm-up
    sample of lengths (see :func:`mixer.plan.edges.bucket_edges`). ``max_batch_size`` caps ``B``;
    ``multiple_of`` rounds ``B`` down to a multiple (e.g. 8 for tensor cores; the final batches of a
    finite pass may be smaller). Samples longer than ``max_length`` are cut to it
    (``overlong="truncate"``) or dropped (``"drop"``), and counted either way; with
    ``max_length=None`` a sample longer than ``max_tokens`` is an error. ``num_buckets`` and
    ``max_bucket_ratio`` shape automatic edges. ``max_wait``: a bucket whose oldest sample has waited
    while this many batches left the same bucketer goes out as a partial batch, so a rare length is
    never held back for long (None: twice the number of buckets; with ``stop="never"``, a small
    source's at most a quarter of its epoch, see :func:`mixer.batching.batchers.epoch_wait`).
    """

    max_tokens: int
    _: KW_ONLY
    buckets: Sequence[int] | None = None
    max_batch_size: int | None = None
    multiple_of: int = 1
    max_length: int | None = None
    overlong: Literal["truncate", "drop"] = "truncate"
    num_buckets: int = 16
    max_bucket_ratio: float = 1.05
    max_wait: int | None = None

    def __post_init__(self) -> None:
        w = "TokenBudget"
        _set(self, "max_tokens", _check.count(self.max_tokens, f"{w}.max_tokens"))
        _set(
            self,
            "max_length",
            _check.optional(self.max_length, _check.count, f"{w}.max_length", maximum=self.max_tokens),
        )
        for name in ("max_batch_size", "max_wait"):
            _set(self, name, _check.optional(getattr(self, name), _check.count, f"{w}.{name}"))
        for name in ("multiple_of", "num_buckets"):
            _set(self, name, _check.count(getattr(self, name), f"{w}.{name}"))
        _check.choice(self.overlong, f"{w}.overlong", OVERLONG)
        _set(
            self,
            "max_bucket_ratio",
            float(_check.number(self.max_bucket_ratio, f"{w}.max_bucket_ratio", minimum=1, strict=True)),
        )
        if self.buckets is not None:
            _set(self, "buckets", self._edges(self.buckets, f"{w}.buckets"))

    def _edges(self, value: Any, where: str) -> tuple[int, ...]:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Sequence, np.ndarray)) or not len(value):
            _check.fail(where, f"must be a non-empty list of increasing lengths, got {_check.show(value)}")
        edges = tuple(_check.count(e, _check.at(where, i)) for i, e in enumerate(value))
        for i in range(1, len(edges)):
            if edges[i] <= edges[i - 1]:
                _check.fail(
                    _check.at(where, i), f"must be greater than {where}[{i - 1}] ({edges[i - 1]}), got {edges[i]}"
                )
        if edges[-1] > self.longest:
            what = "max_length" if self.max_length is not None else "max_tokens"
            _check.fail(_check.at(where, len(edges) - 1), f"must be <= {what} ({self.longest}), got {edges[-1]}")
        return edges

    @property
    def longest(self) -> int:
        """The longest sample a batch may hold."""
        return self.max_length if self.max_length is not None else self.max_tokens

    def capacity(self, edge: int) -> int:
        """Samples per batch for a bucket whose samples are at most ``edge`` long."""
        size = self.max_tokens // edge
        if self.max_batch_size is not None:
            size = min(size, self.max_batch_size)
        if size >= self.multiple_of:
            size -= size % self.multiple_of
        return max(size, 1)


@dataclass(frozen=True)
class Packed(_Described):
    """Batches of documents packed back to back instead of padded (use as ``Mixture(batching=...)``).

    ``seq_len=None``: one flat run of at most ``max_tokens`` real tokens per batch, no padding.
    ``seq_len=S``: ``max_tokens // S`` rows of ``S`` slots; documents go to the first row with room
    (first fit over the rows of the ``open_batches`` batches being filled), the rest of a row is
    padding. ``split_documents=True``: a document that fits in no open row, or is longer than a row,
    is cut into pieces that fill the open rows' free space and continue in new rows (and batches):
    rows are then full except in the last batch of a finite pass, and split documents are counted
    (counter ``split``). Without it a document must fit in a row (or in ``max_tokens`` flat).

    ``max_length`` / ``overlong``: longer documents are cut to ``max_length`` or dropped, counted, as
    with :class:`TokenBudget`. ``open_batches``: batches filled at once; more means fuller rows
    and samples held a little longer (a batch leaves when it is full, or as the oldest when one more
    is needed).
    """

    max_tokens: int
    _: KW_ONLY
    seq_len: int | None = None
    split_documents: bool = False
    max_length: int | None = None
    overlong: Literal["truncate", "drop"] = "truncate"
    open_batches: int = 4

    def __post_init__(self) -> None:
        w = "Packed"
        _set(self, "max_tokens", _check.count(self.max_tokens, f"{w}.max_tokens"))
        _set(self, "seq_len", _check.optional(self.seq_len, _check.count, f"{w}.seq_len", maximum=self.max_tokens))
        _check.boolean(self.split_documents, f"{w}.split_documents")
        _check.choice(self.overlong, f"{w}.overlong", OVERLONG)
        _set(self, "open_batches", _check.count(self.open_batches, f"{w}.open_batches"))
        if self.max_length is not None:
            _set(self, "max_length", _check.count(self.max_length, f"{w}.max_length"))
            if not self.split_documents and self.max_length > self.row_len:
                # A document that is never split must fit in one row.
                what = "seq_len" if self.seq_len is not None else "max_tokens"
                _check.fail(
                    f"{w}.max_length",
                    f"must be <= {what} ({self.row_len}) unless split_documents is true, got {self.max_length}",
                )

    @property
    def rows(self) -> int:
        return self.max_tokens // self.seq_len if self.seq_len is not None else 1

    @property
    def row_len(self) -> int:
        return self.seq_len if self.seq_len is not None else self.max_tokens

    @property
    def longest(self) -> int:
        """The longest document a batch may hold (split documents: no limit but ``max_length``)."""
        if self.max_length is not None:
            return self.max_length
        return int(np.iinfo(np.int64).max) if self.split_documents else self.row_len


@dataclass(frozen=True)
class Field(_Described):
    """How one field of a multi-field sample is collated: its batch ``dtype`` (one of
    ``FIELD_DTYPES``: ``uint8``, ``int8``, ``int16``, ``int32``, ``int64``, ``float16``, ``bfloat16``,
    ``float32``, ``float64``; values are cast with numpy's ``same_kind`` rule, so float audio never
    silently becomes int; bfloat16 rounds to nearest even, as torch does) and the ``pad`` value past
    each sample's length (exactly representable in an int dtype; rounded but finite in a float dtype).

    ``feature_shape``: the shape of one time step, for fields of more than one dimension: with
    ``feature_shape=(80,)`` each sample's array is ``[T, 80]`` (log-mel frames, say), its length is
    ``T``, and the batch holds ``[B, T_max, 80]`` padded along ``T``. ``()``: 1-D samples."""

    dtype: str = "int32"
    _: KW_ONLY
    pad: float = 0
    feature_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check.choice(self.dtype, "Field.dtype", FIELD_DTYPES)
        _check.representable(self.pad, "Field.pad", "float32" if self.dtype == "bfloat16" else self.dtype)
        shape = self.feature_shape
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            _check.fail("Field.feature_shape", f"must be a sequence of sizes, got {_check.show(shape)}")
        dims = tuple(_check.count(d, _check.at("Field.feature_shape", i)) for i, d in enumerate(shape))
        object.__setattr__(self, "feature_shape", dims)  # a config's list, held as a tuple

    def describe(self) -> dict[str, Any]:
        described = super().describe()
        if not self.feature_shape:  # 1-D fields describe themselves as before feature_shape existed
            del described["feature_shape"]
        return described


def check_fields(fields: Any, where: str = "fields") -> dict[str, Field]:
    """A ``fields=`` mapping: identifiers to :class:`Field`, none named like a view every batch has."""
    if not isinstance(fields, Mapping) or not fields:
        _check.fail(where, f"must be a non-empty mapping of name -> mixer.Field, got {_check.show(fields)}")
    out: dict[str, Field] = {}
    for name, f in fields.items():
        p = _check.at(where, name) if isinstance(name, str) else f"{where}[{name!r}]"
        if not isinstance(name, str) or not name.isidentifier():
            _check.fail(p, f"a field name must be an identifier, got {name!r}")
        if name in RESERVED_FIELDS or (name.endswith("_lengths") and name[: -len("_lengths")] in fields):
            _check.fail(p, f"collides with a view every batch has ({', '.join(RESERVED_FIELDS)}, <field>_lengths)")
        if not isinstance(f, Field):
            raise ConfigError(f"{p}: expected a mixer.Field, got {type(f).__name__}")
        out[name] = f
    return out
