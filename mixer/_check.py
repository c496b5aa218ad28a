"""The one set of validators every configuration class uses.

Each check takes the value and ``where`` it came from and raises :class:`~mixer.errors.ConfigError`
as ``"<where>: <rule>, got <value>"``. A class passes ``"<Class>.<field>"`` (``TokenBudget.max_tokens``,
``Source('web').weight``); the config loader builds the same classes and puts the key path in place
of that prefix (``batching.max_tokens``, ``sources[1].weight``) with :func:`relabel`, so code and
YAML say the same thing about the same value.
"""

from __future__ import annotations

import difflib
import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from mixer.errors import ConfigError


def fail(where: str, rule: str) -> NoReturn:
    raise ConfigError(f"{where}: {rule}")


def at(path: str, key: str | int) -> str:
    """``path`` extended by a key (``a.b``) or an index (``a[1]``)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def show(value: Any) -> str:
    """A value as an error shows it; containers and None with their type, so ``[]`` reads as a list."""
    if isinstance(value, (Mapping, list, tuple)) or value is None:
        return f"{value!r} ({type(value).__name__})"
    return repr(value)


def hint(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def number(
    value: Any,
    where: str,
    *,
    minimum: float | None = None,
    strict: bool = False,
    maximum: float | None = None,
    integer: bool = False,
) -> Any:
    """A finite number, never a bool; with ``integer`` an int (an integral float such as ``1e5`` or a
    numpy integer is converted; ``2.5`` is an error). ``strict``: the minimum itself is excluded."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.number)):
        fail(where, f"must be {kind}, got {show(value)}")
    if not math.isfinite(value):
        fail(where, f"must be finite, got {value!r}")
    if integer:
        if isinstance(value, (numbers.Integral, np.integer)):
            value = operator.index(value)
        elif float(value).is_integer():
            value = int(float(value))
        else:
            fail(where, f"must be {kind}, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        fail(where, f"must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    if maximum is not None and value > maximum:
        fail(where, f"must be <= {maximum:g}, got {value!r}")
    return value


def count(value: Any, where: str, *, maximum: int | None = None) -> int:
    """An integer >= 1."""
    return int(number(value, where, minimum=1, maximum=maximum, integer=True))


def optional(value: Any, check: Any, where: str, **kw: Any) -> Any:
    """None, or ``check(value, where, **kw)``."""
    return None if value is None else check(value, where, **kw)


def choice(value: Any, where: str, choices: Sequence[str]) -> Any:
    if not isinstance(value, str) or value not in choices:
        close = hint(value, choices) if isinstance(value, str) else ""
        fail(where, f"must be one of {', '.join(map(repr, choices))}, got {show(value)}{close}")
    return value


def string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        fail(where, f"must be a non-empty string, got {show(value)}")
    return value


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        fail(where, f"must be true or false, got {show(value)}")
    return value


def mapping(value: Any, where: str) -> Mapping[str, Any]:
    """A mapping with string keys."""
    if not isinstance(value, Mapping):
        fail(where or "config", f"must be a mapping, got {show(value)}")
    for key in value:
        if not isinstance(key, str):
            fail(where or "config", f"keys must be strings, got {key!r}")
    return value


def callable_(value: Any, where: str) -> Any:
    if not callable(value):
        fail(where, f"must be callable, got {show(value)}")
    return value


def representable(value: Any, where: str, dtype: str) -> Any:
    """A number that ``dtype`` holds: exactly in an int dtype, rounded but finite (unless given as
    inf or NaN) in a float dtype."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.number)):
        fail(where, f"must be a number, got {show(value)}")
    try:
        with np.errstate(invalid="ignore", over="ignore"):
            back = np.array(value).astype(dtype).item()  # a Python number again
    except (OverflowError, ValueError):  # an int beyond int64
        back = None
    if np.dtype(dtype).kind == "f":
        ok = back is not None and (math.isnan(value) or math.isinf(back) == math.isinf(value))
    else:
        ok = back == value
    if not ok:
        fail(where, f"{value!r} is not representable as {dtype}")
    return value


def relabel(exc: ConfigError, owner: str, path: str) -> ConfigError:
    """``exc`` (raised by a class as ``<owner>.<field>: ...``) with ``path`` in place of ``owner``:
    the same message, located by the key path of a config file."""
    message = str(exc)
    if not message.startswith(owner + ".") and not message.startswith(owner + ":"):
        return exc
    return ConfigError(message.replace(owner + ".", f"{path}." if path else "").replace(owner + ":", f"{path}:"))


def keys(m: Mapping[str, Any], where: str, allowed: Sequence[str], required: Sequence[str] = ()) -> None:
    """Every key of ``m`` known (else a "did you mean" hint, or the list), every required one given."""
    for key in m:
        if key not in allowed:
            close = hint(key, allowed) or f" (expected one of: {', '.join(allowed)})"
            fail(at(where, key), f"unknown key{close}")
    for key in required:
        if key not in m:
            fail(at(where, key), "required")


def entry(m: Mapping[str, Any], key: str, default: Any, check: Any, where: str) -> Any:
    """``m[key]`` checked by ``check(value, path)``, or ``default`` when absent; an explicit null is
    allowed only where the default is None."""
    if key not in m:
        return default
    value = m[key]
    if value is None and default is None:
        return None
    return check(value, at(where, key))
