"""How much each source of a reader may hold ahead of delivery, from the shares it is read at now.

Why: a source read at a 0.5% share that kept a full shuffle buffer and filled every length bucket
before its first batch would read (and hold) hundreds of times what it delivers; with hundreds of
sources that is the loader's memory. Sized by the share instead, a rare source holds little, and
with a ``buffer_budget`` all sources together hold at most the budget. A pure function of the
shares, so resumed readers size their buffers the same way at the same points.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from mixer.mixing.options import BufferBudget

__all__ = ["BUDGET_FLOOR", "HOLD_MIN_BATCHES", "MIN_SHUFFLE", "UNCAPPED", "Allotment", "allot"]

MIN_SHUFFLE = 16  # the smallest shuffle buffer a rarely read source is cut down to
HOLD_MIN_BATCHES = 2.0  # the least a rarely read source's buckets may hold, in batches of padded tokens
BUDGET_FLOOR = 32  # the least of a budget in samples a source gets (when the budget allows)
UNCAPPED = 1 << 62  # no cap


class Allotment(NamedTuple):
    """What each source may hold, one entry per source (``UNCAPPED``: no cap of that kind).
    ``limits``: its shuffle buffer's size in samples; ``token_limits``: in tokens; ``holds``: its
    buckets' hold in padded tokens (past it the best batch leaves, whatever its padding); ``caps``
    and ``token_caps``: its batcher's part of the budget, in items and in padded tokens (the same
    for every source, the shared batcher's, in ``mix="sample"``)."""

    limits: list[int]
    token_limits: list[int]
    holds: list[int]
    caps: list[int]
    token_caps: list[int]


def allot(
    probs: np.ndarray,
    *,
    shuffle_buffer: int,
    buckets: Sequence[int],
    max_tokens: int,
    budget: BufferBudget | None,
    shared: bool,
) -> Allotment:
    """What each source may hold at the shares ``probs``.

    With ``r = p / max(p)`` (1 for the most wanted source) a source's shuffle buffer keeps
    ``max(ceil(r * shuffle_buffer), min(shuffle_buffer, MIN_SHUFFLE))`` samples and its buckets
    ``max(r * buckets, 2)`` batches of padded tokens; beyond that the best batch they can make leaves
    (see :meth:`mixer.batching.batchers.Bucketer.release`: fewer or shorter-padded samples), so a source at a
    0.5% share reads about what it delivers instead of filling every bucket first. Unchanged for the
    most wanted source: ``buckets`` buckets, each short of a full batch, never hold that many batches.
    A source without buckets (``Packed``: its packer holds at most ``open_batches`` batches) has no hold.

    Within a budget of ``B`` (tokens or samples), source ``i`` gets ``a_i = f + floor((B - n f) p_i)``,
    so that a rare source still makes batches: ``f = min(BUDGET_FLOOR, B // n)`` samples, or
    ``f = min(max_tokens, B // 2n)`` tokens (floors take at most half a token budget). In samples,
    at most half of ``a_i`` goes to its shuffle buffer and the rest to its buckets, which also get
    what the shuffle buffer's share-sized limit leaves unused. In tokens, a quarter goes to its
    shuffle buffer and three quarters to its buckets (how many tokens a number of samples holds is
    known only once read, so nothing is passed on; and buckets need about a batch of tokens to
    make full batches, a shuffle buffer only a few samples to mix). ``shared``, i.e.
    ``mix="sample"``: the shared buckets get what the shuffle buffers leave. The sum never exceeds
    the budget."""
    n = len(probs)
    top = float(probs.max())
    r = probs / top if top > 0 else np.ones_like(probs)
    limits = np.maximum(np.ceil(r * shuffle_buffer), min(shuffle_buffer, MIN_SHUFFLE)).astype(np.int64)
    edges = np.asarray(buckets, dtype=np.float64)
    holds = np.where(edges > 0, np.maximum(r * edges, HOLD_MIN_BATCHES) * max_tokens, UNCAPPED).astype(np.int64)
    none = [UNCAPPED] * n
    if budget is None:
        return Allotment(limits.tolist(), none, holds.tolist(), none, none)
    b = budget.amount
    floor = min(BUDGET_FLOOR, b // n) if budget.unit == "samples" else min(max_tokens, b // (2 * n))
    allotted = floor + np.floor((b - n * floor) * (probs / probs.sum())).astype(np.int64)
    if budget.unit == "samples":
        limits = np.minimum(limits, allotted // 2)
        caps = [int(b - limits.sum())] * n if shared else (allotted - limits).tolist()
        return Allotment(limits.tolist(), none, holds.tolist(), caps, none)
    token_limits = allotted // 4
    token_caps = [int(b - token_limits.sum())] * n if shared else (allotted - token_limits).tolist()
    return Allotment(limits.tolist(), token_limits.tolist(), holds.tolist(), none, token_caps)
