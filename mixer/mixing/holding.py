"""How much each source of a reader may hold ahead of delivery, from the shares it is read at now.

Why: a source read at a 0.5% share that kept a full shuffle buffer and filled every length bucket
before its first batch would read (and hold) hundreds of times what it delivers; with hundreds of
sources that is the loader's memory. Sized by the share instead, a rare source holds little, and
with a ``buffer_budget`` all sources together hold at most the budget. A pure function of the
shares, so resumed readers size their buffers the same way at the same points.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["BUDGET_FLOOR", "HOLD_MIN_BATCHES", "MIN_SHUFFLE", "allot"]

MIN_SHUFFLE = 16  # the smallest shuffle buffer a rarely read source is cut down to
HOLD_MIN_BATCHES = 2.0  # the least a rarely read source's buckets may hold, in batches of padded tokens
BUDGET_FLOOR = 32  # the least of the buffer budget a source gets, in samples (when the budget allows)


def allot(
    probs: np.ndarray,
    *,
    shuffle_buffer: int,
    buckets: Sequence[int],
    max_tokens: int,
    buffer_budget: int | None,
    shared: bool,
) -> tuple[list[int], list[int], list[int] | None]:
    """(shuffle-buffer limits, bucket holds in padded tokens, batcher caps in samples or None when
    there is no budget), one per source, for the shares ``probs``.

    With ``r = p / max(p)`` (1 for the most wanted source) a source's shuffle buffer keeps
    ``max(ceil(r * shuffle_buffer), min(shuffle_buffer, MIN_SHUFFLE))`` samples and its buckets
    ``max(r * buckets, 2)`` batches of padded tokens; beyond that the best batch they can make leaves
    (see :meth:`mixer.batching.batchers.Bucketer.release`: fewer or shorter-padded samples), so a source at a
    0.5% share reads about what it delivers instead of filling every bucket first. Unchanged for the
    most wanted source: ``buckets`` buckets, each short of a full batch, never hold that many batches.

    Within ``buffer_budget``, source ``i`` gets ``a_i = f + floor((budget - n f) p_i)`` samples
    (``f = min(BUDGET_FLOOR, budget // n)``, so a rare source still makes batches), at most half for
    its shuffle buffer, the rest for its buckets (``shared``, i.e. ``mix="sample"``: the shared
    buckets get what the shuffle buffers leave). The sum never exceeds the budget."""
    top = float(probs.max())
    r = probs / top if top > 0 else np.ones_like(probs)
    limits = np.maximum(np.ceil(r * shuffle_buffer), min(shuffle_buffer, MIN_SHUFFLE)).astype(np.int64)
    holds = (
        (np.maximum(r * np.asarray(buckets, dtype=np.float64), HOLD_MIN_BATCHES) * max_tokens).astype(np.int64).tolist()
    )
    if buffer_budget is None:
        return limits.tolist(), holds, None
    n = len(probs)
    floor = min(BUDGET_FLOOR, buffer_budget // n)
    allotted = floor + np.floor((buffer_budget - n * floor) * (probs / probs.sum())).astype(np.int64)
    limits = np.minimum(limits, allotted // 2)
    caps = [int(buffer_budget - limits.sum())] * n if shared else (allotted - limits).tolist()
    return limits.tolist(), holds, caps
