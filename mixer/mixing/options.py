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
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from mixer import _check, _warn
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
BUDGET_UNITS = ("tokens", "samples")
# Tokens a reader may hold in shuffle buffers and buckets together, over all its sources: above what
# 3 sources of short samples hold with the default buffers (~4M), 32 MB of int32 tokens.
DEFAULT_BUFFER_BUDGET = "8000000 tokens"
_SUFFIXES = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}
_BUDGET_TEXT = re.compile(r"\s*(\d[\d_]*)\s*([kKMG]?)\s+(\w+)\s*")


class BufferBudget(NamedTuple):
    """A reader's buffer budget: ``amount`` of ``unit`` (``"tokens"``: sample lengths, so memory
    does not grow with sample length; ``"samples"``: a count, as before tokens were counted)."""

    amount: int
    unit: Literal["tokens", "samples"]

    def __str__(self) -> str:
        return f"{self.amount} {self.unit}"

    def describe(self) -> int | str:
        """As the fingerprint holds it: a count of samples as the bare integer it always was (a
        state saved with ``buffer_budget=65536`` still loads with ``"65536 samples"``)."""
        return self.amount if self.unit == "samples" else str(self)


def parse_buffer_budget(value: Any, where: str) -> BufferBudget | None:
    """``"<n>[k|M|G] tokens"`` or ``"<n> samples"`` (``k``, ``M``, ``G``: 10**3, 10**6, 10**9),
    None for no budget; a bare integer counts samples, as it did before the unit was given, and
    warns (a ``FutureWarning``) that memory then grows with sample length."""
    if value is None or isinstance(value, BufferBudget):
        return value
    if isinstance(value, str):
        m = _BUDGET_TEXT.fullmatch(value)
        if m is None or m.group(3) not in BUDGET_UNITS:
            _check.fail(
                where,
                "must be a number of tokens or samples such as '8M tokens' or '65536 samples' "
                f"(units: {', '.join(BUDGET_UNITS)}; suffixes k, M, G), got {value!r}",
            )
        amount = int(m.group(1).replace("_", "")) * _SUFFIXES[m.group(2)]
        return BufferBudget(_check.count(amount, where), m.group(3))  # type: ignore[arg-type]
    amount = _check.count(value, where)
    _warn.warn(
        f"{where}={amount}: a bare integer counts samples, so a reader's memory grows with sample length; write "
        f"'{amount} samples' to keep this meaning, or a token budget such as '{DEFAULT_BUFFER_BUDGET}' (the default)",
        FutureWarning,
    )
    return BufferBudget(amount, "samples")


@dataclass(frozen=True)
class Option:
    """One option: ``check(value, where)`` returns the value normalised (integral floats to ints) or
    raises a `ConfigError` starting with ``where`` (``Mixture.<name>``, as :mod:`mixer._check` words
    it); ``decides_stream``: the option changes which batches come out, so it is in the fingerprint
    (as ``described(value)`` holds it)."""

    name: str
    default: Any
    check: Callable[[Any, str], Any]
    decides_stream: bool = True
    #: How the fingerprint holds the checked value (None: as it is).
    described: Callable[[Any], Any] | None = None

    def describe(self, value: Any) -> Any:
        return value if self.described is None else self.described(value)


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
        Option(
            "buffer_budget",
            DEFAULT_BUFFER_BUDGET,
            lambda v, w: _canonical(parse_buffer_budget(v, w)),
            described=lambda v: None if v is None else parse_buffer_budget(v, "buffer_budget").describe(),  # type: ignore[union-attr]
        ),
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


def _canonical(budget: BufferBudget | None) -> str | None:
    return None if budget is None else str(budget)
