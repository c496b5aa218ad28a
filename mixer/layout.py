"""Configuration of the layouts beyond the padded ``[B, L]``: :class:`Packed` (documents packed back
to back) and :class:`Field` (samples of several named fields). The collates are
:mod:`mixer.collate`'s, the batch types :mod:`mixer.batch`'s, the packer :mod:`mixer.batchers`'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

import numpy as np

from .batch import FIELD_DTYPES
from .decode import decoded_fields, field_length  # noqa: F401  (re-exported for mixer.source)
from .errors import ConfigError

_RESERVED = ("source", "lengths")


# ---- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class Packed:
    """Batches of documents packed back to back instead of padded (use as ``Mixture(batching=...)``).

    ``seq_len=None``: one flat run of at most ``max_tokens`` real tokens per batch, no padding.
    ``seq_len=S``: ``max_tokens // S`` rows of ``S`` slots; documents go to the first row with room
    (first fit over the rows of the ``open_batches`` batches being filled), the rest of a row is
    padding. ``split_documents=True``: a document that fits in no open row, or is longer than a row,
    is cut into pieces that fill the open rows' free space and continue in new rows (and batches):
    rows are then full except in the last batch of a finite pass, and split documents are counted
    (counter ``split``). Without it a document must fit in a row (or in ``max_tokens`` flat).

    ``max_length`` / ``overlong``: longer documents are cut to ``max_length`` or dropped, counted, as
    with :class:`~mixer.TokenBudget`. ``open_batches``: batches filled at once; more means fuller rows
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
        def positive(v: Any) -> bool:
            return bool(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1)

        if not positive(self.max_tokens):
            raise ConfigError(f"Packed: max_tokens must be a positive int (got {self.max_tokens!r})")
        if self.seq_len is not None and not (positive(self.seq_len) and self.seq_len <= self.max_tokens):
            raise ConfigError(f"Packed: seq_len must be an int in [1, max_tokens={self.max_tokens}] or None (got {self.seq_len!r})")
        if not isinstance(self.split_documents, bool):
            raise ConfigError(f"Packed: split_documents must be True or False (got {self.split_documents!r})")
        if self.overlong not in ("truncate", "drop"):
            raise ConfigError(f"Packed: overlong must be 'truncate' or 'drop' (got {self.overlong!r})")
        if not positive(self.open_batches):
            raise ConfigError(f"Packed: open_batches must be an int >= 1 (got {self.open_batches!r})")
        if self.max_length is not None:
            if not positive(self.max_length):
                raise ConfigError(f"Packed: max_length must be a positive int or None (got {self.max_length!r})")
            if not self.split_documents and self.max_length > self.row_len:
                raise ConfigError(
                    f"Packed: max_length={self.max_length} exceeds a row ({self.row_len} tokens) and split_documents is "
                    "False: such a document could never be placed"
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
        return np.iinfo(np.int64).max if self.split_documents else self.row_len


@dataclass(frozen=True)
class Field:
    """How one field of a multi-field sample is collated: its batch ``dtype`` (one of
    ``FIELD_DTYPES``; values are cast with numpy's ``same_kind`` rule, so float audio never silently
    becomes int) and the ``pad`` value past each sample's length."""

    dtype: str = "int32"
    pad: float = 0

    def __post_init__(self) -> None:
        if self.dtype not in FIELD_DTYPES:
            raise ConfigError(f"Field: dtype must be one of {tuple(FIELD_DTYPES)} (got {self.dtype!r})")
        if isinstance(self.pad, bool) or not isinstance(self.pad, (int, float, np.number)):
            raise ConfigError(f"Field: pad must be a number (got {self.pad!r})")
        cast = np.array(self.pad).astype(FIELD_DTYPES[self.dtype][0])
        if not bool(cast == self.pad or (np.isnan(self.pad) and np.isnan(cast))):
            raise ConfigError(f"Field: pad {self.pad!r} is not representable as {self.dtype}")


def check_fields(fields: Any) -> dict[str, Field]:
    if not isinstance(fields, Mapping) or not fields:
        raise ConfigError(f"fields: expected a non-empty mapping of name -> mixer.Field (got {fields!r})")
    out: dict[str, Field] = {}
    for name, f in fields.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"fields: names must be identifiers (got {name!r})")
        if not isinstance(f, Field):
            raise ConfigError(f"fields[{name!r}]: expected a mixer.Field (got {type(f).__name__})")
        out[name] = f
    names = set(out)
    for name in out:
        if name in _RESERVED or name.endswith("_lengths") and name[: -len("_lengths")] in names:
            raise ConfigError(f"fields: name {name!r} collides with a view the batch has ({', '.join(_RESERVED)}, <field>_lengths)")
    return out
