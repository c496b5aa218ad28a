"""The batch budget of the bucketed layouts (padded and multi-field): :class:`TokenBudget`. Length
buckets and their edges are :mod:`mixer.batchers`' and :mod:`mixer.edges`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Literal

import numpy as np

from .batchers import Bucketer  # noqa: F401  (re-exported from its old home until callers move)
from .edges import bucket_edges  # noqa: F401  (re-exported from its old home until callers move)
from .errors import ConfigError


@dataclass(frozen=True)
class TokenBudget:
    """Batches whose padded size ``B * L`` stays within ``max_tokens``.

    ``buckets``: explicit, increasing bucket upper edges (lengths); None derives them from a warm-up
    sample of lengths (see :func:`bucket_edges`). ``max_batch_size`` caps ``B``; ``multiple_of``
    rounds ``B`` down to a multiple (e.g. 8 for tensor cores; the final batches of a finite pass may
    be smaller). Samples longer than ``max_length`` are cut to it (``overlong="truncate"``) or
    dropped (``"drop"``), and counted either way; with ``max_length=None`` a sample longer than
    ``max_tokens`` is an error. ``num_buckets`` and ``max_bucket_ratio`` shape automatic edges.
    ``max_wait``: a bucket whose oldest sample has waited while this many batches left the same
    bucketer goes out as a partial batch, so a rare length is never held back for long (None: twice
    the number of buckets).
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
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"TokenBudget: max_tokens must be a positive int (got {self.max_tokens!r})")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ConfigError(f"TokenBudget: max_batch_size must be >= 1 (got {self.max_batch_size})")
        if self.multiple_of < 1:
            raise ConfigError(f"TokenBudget: multiple_of must be >= 1 (got {self.multiple_of})")
        if self.max_length is not None and not 1 <= self.max_length <= self.max_tokens:
            raise ConfigError(
                f"TokenBudget: max_length must be in [1, max_tokens={self.max_tokens}] (got {self.max_length}): "
                "a sample of max_length must fit in one batch"
            )
        if self.overlong not in ("truncate", "drop"):
            raise ConfigError(f"TokenBudget: overlong must be 'truncate' or 'drop' (got {self.overlong!r})")
        if self.num_buckets < 1:
            raise ConfigError(f"TokenBudget: num_buckets must be >= 1 (got {self.num_buckets})")
        if not self.max_bucket_ratio > 1:
            raise ConfigError(f"TokenBudget: max_bucket_ratio must be > 1 (got {self.max_bucket_ratio})")
        if self.max_wait is not None and self.max_wait < 1:
            raise ConfigError(f"TokenBudget: max_wait must be >= 1 batch or None (got {self.max_wait})")
        if self.buckets is not None:
            edges = list(self.buckets)
            if not edges or any(not isinstance(e, (int, np.integer)) or e < 1 for e in edges):
                raise ConfigError(f"TokenBudget: buckets must be positive ints (got {edges})")
            if any(b <= a for a, b in zip(edges, edges[1:])):
                raise ConfigError(f"TokenBudget: buckets must be strictly increasing (got {edges})")
            if edges[-1] > self.longest:
                raise ConfigError(f"TokenBudget: bucket edge {edges[-1]} exceeds the longest allowed sample {self.longest}")

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
