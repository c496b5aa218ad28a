"""The :class:`~mixer.Mixture`'s options beside its sources and parts (batching, schedule, fields)
and its deployment (rank, world size, group): one table, `OPTIONS`, of each option's name, default,
check and whether it decides the stream. Everything else derives from it: the Mixture's check and
its attributes, a config file's keys, defaults and messages (:mod:`mixer.config.mixture_config`),
and the fingerprint (:mod:`mixer.mixing.fingerprint`: every option that decides the stream, and
only those, so a resume under another ``profile_cache`` is not refused). The Mixture spells the
options out in its signature for type checkers and IDEs; a test holds its defaults to the table's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from mixer import _check
from mixer.mixing.selector import SELECTORS
from mixer.plan.profiling import check_profile_cache, check_profile_share
from mixer.spec.dtypes import _DTYPES

__all__ = ["DEFAULT_BUFFER_BUDGET", "OPTIONS", "STREAM_OPTIONS", "Option", "check_options"]

Unit = Literal["tokens", "samples"]
MixMode = Literal["batch", "sample"]
Stop = Literal["never", "first_exhausted", "all_exhausted"]
UNITS = ("tokens", "samples")
MIXES = ("batch", "sample")
STOPS = ("never", "first_exhausted", "all_exhausted")
# Samples a reader may hold in shuffle buffers and buckets together, over all its sources: well
# above what 3 sources hold with the default buffers (~25k), ~65 a source at 1,000 sources.
DEFAULT_BUFFER_BUDGET = 65536


@dataclass(frozen=True)
class Option:
    """One option: ``check(value, where)`` returns the value normalised (integral floats to ints) or
    raises a `ConfigError` starting with ``where`` (``Mixture.<name>``, as :mod:`mixer._check` words
    it); ``decides_stream``: the option changes which batches come out, so it is in the fingerprint."""

    name: str
    default: Any
    check: Callable[[Any, str], Any]
    decides_stream: bool = True


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], Any]:
    return functools.partial(_check.choice, choices=choices)


def _integer(**bounds: Any) -> Callable[[Any, str], Any]:
    return functools.partial(_check.number, integer=True, **bounds)


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option("selector", "deficit", _choice(tuple(SELECTORS))),
        Option("unit", "tokens", _choice(UNITS)),
        Option("mix", "batch", _choice(MIXES)),
        Option("stop", "never", _choice(STOPS)),
        Option("seed", 0, _integer(minimum=0)),
        Option("shuffle_buffer", 1000, _integer(minimum=0)),
        Option("pad_id", 0, _integer()),
        Option("dtype", "int32", _choice(tuple(_DTYPES))),
        Option("state_every", 64, _check.count),
        Option("buffer_budget", DEFAULT_BUFFER_BUDGET, lambda v, w: _check.optional(v, _check.count, w)),
        # Where and by whom sources are looked at up front: the same profiles either way.
        Option("profile_cache", None, lambda v, w: check_profile_cache(v), decides_stream=False),
        Option("profile_share", None, lambda v, w: check_profile_share(v), decides_stream=False),
    )
}
"""Every option, in the order they are checked (and written to a config file)."""

STREAM_OPTIONS = tuple(name for name, o in OPTIONS.items() if o.decides_stream)
"""The options the fingerprint holds."""


def check_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of `OPTIONS` checked and normalised, the default where ``values`` lacks it
    (other keys are ignored): the one check for code and for a config file."""
    return {name: o.check(values.get(name, o.default), f"Mixture.{name}") for name, o in OPTIONS.items()}
