"""The :class:`~mixer.Mixture`'s options beside sources and batching: their choices and their one
check, used by the Mixture and by a config file's loader alike."""

from __future__ import annotations

from typing import Any, Literal

from mixer import _check
from mixer.mixing.selector import SELECTORS
from mixer.spec.dtypes import _DTYPES

Unit = Literal["tokens", "samples"]
MixMode = Literal["batch", "sample"]
Stop = Literal["never", "first_exhausted", "all_exhausted"]
UNITS = ("tokens", "samples")
MIXES = ("batch", "sample")
STOPS = ("never", "first_exhausted", "all_exhausted")
# Samples a reader may hold in shuffle buffers and buckets together, over all its sources: well
# above what 3 sources hold with the default buffers (~25k), ~65 a source at 1,000 sources.
DEFAULT_BUFFER_BUDGET = 65536


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
        "buffer_budget": _check.optional(buffer_budget, _check.count, f"{w}.buffer_budget"),
    }
