"""Turning one tar sample into a :class:`mixer.read.decode.Sample`: the source's decode, its length, and
the length policy (truncate or drop, counted) and ``on_error`` policy applied to it. Shared by the
readers (`mixer.stream.source_stream`), the up-front look (`mixer.plan.profiling`, `mixer.plan.index`) and the
re-reading of
buffered samples on resume (`mixer.stream.reread`), so that all of them judge a sample the same way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from mixer import storage
from mixer.errors import SampleError
from mixer.read.decode import Sample, decoded_fields, default_tokens, field_length
from mixer.spec.budget import Packed, TokenBudget
from mixer.spec.source import Source

if TYPE_CHECKING:
    from mixer.read.counters import Counters


def make_sample(
    source: Source,
    budget: TokenBudget | Packed,
    counters: Counters,
    raw: dict[str, Any],
    shard: int,
    *,
    warn_once: Callable[[int, str], None] | None = None,
) -> Sample | None:
    """Decode one tar sample into a :class:`Sample`, applying the length policy (truncate/drop,
    counted) and the source's ``on_error`` policy; None when it is dropped or skipped."""
    try:
        if source.decode is None and source.length is None:
            tokens = default_tokens(raw)
            n = len(tokens)
        else:
            decoded = _decoded(source, raw, counters)
            if decoded is None:
                return None
            tokens, n = decoded
        if n > budget.longest:
            fitted = _fit(source, budget, counters, raw, tokens, n)
            if fitted is None:
                return None
            tokens, n = fitted
    except SampleError as exc:
        _skip_or_raise(source, counters, raw, shard, exc, warn_once)
        return None
    return Sample(raw["__key__"], tokens, n, shard, raw["__offset__"])


def _decoded(source: Source, raw: dict[str, Any], counters: Counters) -> tuple[Any, int] | None:
    """Tokens and length of a sample; None (counted as dropped) when the decode filters it out."""
    tokens = _decode(source, raw)
    if tokens is None:  # the decode filtered it out (e.g. a duration filter)
        counters.dropped += 1
        return None
    return tokens, _length_of(source, raw, tokens)


def _fit(
    source: Source, budget: TokenBudget | Packed, counters: Counters, raw: dict[str, Any], tokens: Any, n: int
) -> tuple[Any, int] | None:
    """The length policy, the one place that judges a sample's length, up front and mid-stream:
    ``(tokens, n)`` when it fits or is cut to ``budget.longest`` (counted as truncated), None when
    dropped (counted); a :class:`SampleError` naming shard and key when it is too long and the
    budget has no ``max_length`` (the caller applies ``on_error``)."""
    if n <= budget.longest:
        return tokens, n
    if budget.max_length is None:
        seq_len = getattr(budget, "seq_len", None)  # mixer.Packed rows
        limit = f"seq_len={seq_len}" if seq_len else f"max_tokens={budget.max_tokens}"
        how = (
            "split_documents=True to split them, or max_length=... to truncate or drop them"
            if isinstance(budget, Packed)
            else "max_length=... to truncate or drop such samples"
        )
        raise SampleError(
            f"shard {storage.redact(raw['__url__'])}, key {raw['__key__']!r}: length {n} exceeds {limit}; set "
            f"{type(budget).__name__}({how})"
        )
    if budget.overlong == "drop" or source.length is not None or isinstance(tokens, dict):
        counters.dropped += 1
        return None
    counters.truncated += 1
    return tokens[: budget.longest], budget.longest


def _skip_or_raise(
    source: Source,
    counters: Counters,
    raw: dict[str, Any],
    shard: int,
    exc: SampleError,
    warn_once: Callable[[int, str], None] | None,
) -> None:
    """The ``on_error`` policy for a bad sample: raise naming the source, or count and warn."""
    if source.on_error == "raise":
        raise SampleError(f"source {source.name!r}: {exc}") from exc
    counters.skipped_samples += 1
    if warn_once is not None:
        warn_once(
            shard,
            f"source {source.name!r}: skipping bad sample(s) in shard {storage.redact(raw.get('__url__', '?'))}: {exc}",
        )


def _decode(source: Source, raw: dict[str, Any]) -> Any:
    tokens = source.decode(raw) if source.decode is not None else default_tokens(raw)
    if source.decode is not None:
        if tokens is None or isinstance(tokens, Mapping):
            return None if tokens is None else decoded_fields(raw, tokens)
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise SampleError(
                f"shard {storage.redact(raw.get('__url__', '?'))}, key {raw.get('__key__')!r}: decode must return a "
                "1-D "
                f"integer array (got dtype {tokens.dtype}, shape {tokens.shape})"
            )
    return tokens


def _length_of(source: Source, raw: dict[str, Any], tokens: Any) -> int:
    length = source.length
    if isinstance(tokens, dict):  # multi-field (see mixer.batching.collate.FieldLayout)
        return int(length(raw)) if callable(length) else field_length(raw, tokens, length)
    if isinstance(length, str):
        raise SampleError(
            f"shard {storage.redact(raw.get('__url__', '?'))}, key {raw.get('__key__')!r}: length={length!r} names a "
            "field, "
            "but decode returned one array, not a mapping of fields"
        )
    return int(length(raw)) if length is not None else len(tokens)
