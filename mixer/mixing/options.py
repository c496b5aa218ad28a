"""The :class:`~mixer.Mixture`'s options beside sources and batching: their choices and their one
check, used by the Mixture and by a config file's loader alike."""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple

from mixer import _check, _warn
from mixer.mixing.selector import SELECTORS
from mixer.spec.dtypes import _DTYPES

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
        f"{where}={amount}: a bare integer counts samples, so a reader's memory grows with sample length; "
        f"write '{amount} samples' to keep this meaning, or a token budget such as '{DEFAULT_BUFFER_BUDGET}' (the default)",
        FutureWarning,
    )
    return BufferBudget(amount, "samples")


def check_options(
    *,
    selector: str,
    unit: str,
    mix: str,
    stop: str,
    seed: Any,
    shuffle_buffer: Any,
    pad_id: Any,
    dtype: str,
    state_every: Any,
    buffer_budget: Any = DEFAULT_BUFFER_BUDGET,
) -> dict[str, Any]:
    """The Mixture's options checked (``Mixture.<name>: ...``, as :mod:`mixer._check` words it) and
    normalised (integral floats to ints): the one check for code and for a config file."""
    w = "Mixture"
    return {
        "selector": _check.choice(selector, f"{w}.selector", tuple(SELECTORS)),
        "unit": _check.choice(unit, f"{w}.unit", UNITS),
        "mix": _check.choice(mix, f"{w}.mix", MIXES),
        "stop": _check.choice(stop, f"{w}.stop", STOPS),
        "seed": _check.number(seed, f"{w}.seed", minimum=0, integer=True),
        "shuffle_buffer": _check.number(shuffle_buffer, f"{w}.shuffle_buffer", minimum=0, integer=True),
        "pad_id": _check.number(pad_id, f"{w}.pad_id", integer=True),
        "dtype": _check.choice(dtype, f"{w}.dtype", tuple(_DTYPES)),
        "state_every": _check.count(state_every, f"{w}.state_every"),
        "buffer_budget": _canonical(parse_buffer_budget(buffer_budget, f"{w}.buffer_budget")),
    }


def _canonical(budget: BufferBudget | None) -> str | None:
    return None if budget is None else str(budget)
