"""Configuration files: YAML (or the same structure as a dict) → a validated :class:`MixtureSpec` →
a :class:`~mixer.Mixture`.

Everything is checked up front, before any shard is listed, and every error names the key path,
the rule and the value (``sources[2].weight: must be >= 0, got -1``); an unknown key gets a "did you
mean" hint. :func:`parse_config` does no I/O beyond reading the file, so a config can be checked
(and its schedule printed) without touching the data; :func:`build_mixture` then creates the
sources (listing shards) and the mixture. NeMo's ``ConcatDataset`` keys are accepted with NeMo's
meaning (NeMo's ``ConcatDataset``), also with the ``concat_`` prefix of NeMo's ASR configs; see
:data:`NEMO_KEYS`.

Every keyword of :class:`~mixer.Mixture`, :class:`~mixer.Source`, :class:`~mixer.TokenBudget`,
:class:`~mixer.Packed` and :class:`~mixer.Field` has a key of the same name, except deployment
(``rank``, ``world_size``, ``dp_group``) and ``allow_pipe`` (code only: a file must not run shell
commands). Beyond the obvious ones:

* ``batching``: a :class:`~mixer.TokenBudget` (``max_tokens``, ``buckets``, ``max_batch_size``,
  ``multiple_of``, ``max_length``, ``overlong``, ``num_buckets``, ``max_bucket_ratio``,
  ``max_wait``), or with ``packed: true`` a :class:`~mixer.Packed` (``max_tokens``, ``seq_len``,
  ``split_documents``, ``max_length``, ``overlong``, ``open_batches``); an option of the other kind
  is an error.
* ``fields: {audio: {dtype: float32, pad: 0}, text: {dtype: int32, pad: -1}}``: multi-field
  samples (``Mixture(fields=...)``; both keys optional, with :class:`~mixer.Field`'s defaults; not
  with ``packed``). A source's ``length`` is then either an import path or the name of a field.
* ``state_every``: batches between the full reader states carried for exact resume.
* ``sources[i].io_options``: :class:`mixer.io.IOOptions` keys (``timeout``, ``retries``, ``backoff``,
  ``block_size``, ``read_ahead``) for remote shards.
"""

from __future__ import annotations

import difflib
import importlib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from .budget import FIELD_DTYPES, RESERVED_FIELDS
from .errors import ConfigError
from .io import IOOptions
from .schedule import Curriculum, Floored, Hierarchical, Phase, Schedule, Static, Temperature, Weights

if TYPE_CHECKING:
    from .mixture import Mixture

__all__ = ["BatchingSpec", "FieldSpec", "MixtureSpec", "PackedSpec", "SourceSpec", "build_mixture", "load_config", "parse_config"]

SOURCE_KEYS = ("name", "urls", "weight", "size", "decode", "length", "on_error", "storage_options", "group", "io_options")
BATCHING_KEYS = (
    "packed", "max_tokens", "buckets", "max_batch_size", "multiple_of", "max_length", "overlong", "num_buckets",
    "max_bucket_ratio", "max_wait",
)  # fmt: skip
PACKED_KEYS = ("packed", "max_tokens", "seq_len", "split_documents", "max_length", "overlong", "open_batches")
FIELD_KEYS = ("dtype", "pad")
SCHEDULE_KEYS = ("weights", "temperature", "phases", "hierarchical", "min_prob")
TEMPERATURE_KEYS = ("start", "end", "shape", "steps", "tokens", "base")
PHASE_KEYS = ("weights", "until_tokens", "until_steps", "ramp_tokens", "ramp_steps", "temperature")
HIERARCHICAL_KEYS = ("beta_group", "beta_source")
#: NeMo ``ConcatDataset`` argument → the key of NeMo's ASR configs (``get_concat_*_dataset``).
NEMO_KEYS: dict[str, str] = {
    "sampling_technique": "concat_sampling_technique",
    "sampling_temperature": "concat_sampling_temperature",
    "sampling_probabilities": "concat_sampling_probabilities",
    "sampling_scale": "concat_sampling_scale",
    "shuffle": "concat_shuffle",
    "seed": "concat_sampling_seed",
}
NATIVE_KEYS = (
    "sources", "batching", "schedule", "selector", "unit", "mix", "stop", "seed", "shuffle_buffer", "pad_id", "dtype",
    "state_every", "fields",
)  # fmt: skip
ROOT_KEYS = tuple(dict.fromkeys(NATIVE_KEYS + tuple(NEMO_KEYS) + tuple(NEMO_KEYS.values())))

SELECTORS = ("deficit", "random", "round_robin")
UNITS = ("tokens", "samples")
MIXES = ("batch", "sample")
STOPS = ("never", "first_exhausted", "all_exhausted")
DTYPES = ("int32", "int64")  # mixer.batch's token dtypes
ON_ERROR = ("raise", "skip")
OVERLONG = ("truncate", "drop")
SHAPES = ("constant", "linear", "cosine", "step")
BASES = ("sizes", "weights")
NEMO_TECHNIQUES = ("temperature", "random", "round-robin")
NEMO_DEFAULT_TEMPERATURE = 5.0
DEFAULT_SHUFFLE_BUFFER = 1000
DEFAULT_STATE_EVERY = 64

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_MISSING = object()


# --------------------------------------------------------------------------------------------- spec


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """A :class:`~mixer.Source` as configured; ``decode``/``length`` are import paths
    (``"package.module:function"``), resolved by :func:`build_mixture`; ``length`` may instead name a
    field of the config's ``fields``."""

    name: str
    urls: tuple[str, ...]
    weight: float = 1.0
    size: float | None = None
    decode: str | None = None
    length: str | None = None
    on_error: str = "raise"
    storage_options: Mapping[str, Any] | None = None
    group: str | None = None
    io_options: Mapping[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class BatchingSpec:
    """A :class:`~mixer.TokenBudget` as configured (None for ``num_buckets`` / ``max_bucket_ratio``:
    the library's default)."""

    max_tokens: int
    buckets: tuple[int, ...] | None = None
    max_batch_size: int | None = None
    multiple_of: int = 1
    max_length: int | None = None
    overlong: str = "truncate"
    num_buckets: int | None = None
    max_bucket_ratio: float | None = None
    max_wait: int | None = None


@dataclass(frozen=True, kw_only=True)
class PackedSpec:
    """A :class:`~mixer.Packed` as configured (``batching: {packed: true, ...}``; None for
    ``open_batches``: the library's default)."""

    max_tokens: int
    seq_len: int | None = None
    split_documents: bool = False
    max_length: int | None = None
    overlong: str = "truncate"
    open_batches: int | None = None


@dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """A :class:`~mixer.Field` as configured (an entry of ``fields``)."""

    dtype: str = "int32"
    pad: float = 0


@dataclass(frozen=True, kw_only=True)
class MixtureSpec:
    """A validated configuration: plain data plus the schedule object; NeMo keys are already
    translated. ``to_dict()`` gives the canonical config back (``parse_config(spec.to_dict()) == spec``)."""

    sources: tuple[SourceSpec, ...]
    batching: BatchingSpec | PackedSpec
    schedule: Schedule | None = None
    selector: str = "deficit"
    unit: str = "tokens"
    mix: str = "batch"
    stop: str = "never"
    seed: int = 0
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER
    pad_id: int = 0
    dtype: str = "int32"
    state_every: int = DEFAULT_STATE_EVERY
    fields: Mapping[str, FieldSpec] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seed": self.seed, "sources": [_source_to_dict(s) for s in self.sources]}
        batching = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self.batching).items() if v is not None}
        out["batching"] = {"packed": True, **batching} if isinstance(self.batching, PackedSpec) else batching
        if self.schedule is not None:
            out["schedule"] = _schedule_to_dict(self.schedule)
        for key in ("selector", "unit", "mix", "stop", "shuffle_buffer", "pad_id", "dtype", "state_every"):
            out[key] = getattr(self, key)
        if self.fields is not None:
            out["fields"] = {name: {"dtype": f.dtype, "pad": f.pad} for name, f in self.fields.items()}
        return out


def _source_to_dict(s: SourceSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": s.name, "urls": s.urls[0] if len(s.urls) == 1 else list(s.urls), "weight": s.weight}
    for key in ("size", "decode", "length", "group"):
        if getattr(s, key) is not None:
            out[key] = getattr(s, key)
    if s.storage_options:
        out["storage_options"] = dict(s.storage_options)
    if s.on_error != "raise":
        out["on_error"] = s.on_error
    if s.io_options:
        out["io_options"] = dict(s.io_options)
    return out


def _temperature_to_dict(t: Temperature) -> dict[str, Any]:
    out: dict[str, Any] = {"start": t.start}
    if t.shape != "constant":
        out.update(end=t.end, shape=t.shape)
        out["steps" if t.steps is not None else "tokens"] = t.steps if t.steps is not None else t.tokens
    if t.base is not None:
        out["base"] = t.base
    return out


def _schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    if isinstance(schedule, Floored):
        return {**_schedule_to_dict(schedule.schedule), "min_prob": schedule.min_prob}
    if isinstance(schedule, Static):
        return {}
    if isinstance(schedule, Weights):
        return {"weights": dict(schedule.weights)}
    if isinstance(schedule, Temperature):
        return {"temperature": _temperature_to_dict(schedule)}
    if isinstance(schedule, Hierarchical):
        return {"hierarchical": {"beta_group": schedule.beta_group, "beta_source": schedule.beta_source}}
    if isinstance(schedule, Curriculum):
        u = schedule.unit
        phases = []
        for p in schedule.phases:
            d: dict[str, Any] = {}
            if p.until is not None:
                d[f"until_{u}"] = p.until
            if p.weights is not None:
                d["weights"] = dict(p.weights)
            if p.ramp:
                d[f"ramp_{u}"] = p.ramp
            if p.temperature is not None:
                d["temperature"] = _temperature_to_dict(p.temperature)
            phases.append(d)
        out: dict[str, Any] = {"phases": phases}
        if schedule.temperature is not None:
            out["temperature"] = _temperature_to_dict(schedule.temperature)
        return out
    raise ConfigError(f"schedule: {schedule!r} has no config form (only Weights, Temperature, Curriculum, Hierarchical, Floored, Static)")


# --------------------------------------------------------------------------------------- validation


def _at(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _hint(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path or 'config'}: must be a mapping, got {_show(value)}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"{path or 'config'}: keys must be strings, got {key!r}")
    return value


def _keys(m: Mapping[str, Any], path: str, allowed: Sequence[str], required: Sequence[str] = ()) -> None:
    for key in m:
        if key not in allowed:
            hint = _hint(key, allowed) or f" (expected one of: {', '.join(allowed)})"
            raise ConfigError(f"{_at(path, key)}: unknown key{hint}")
    for key in required:
        if key not in m:
            raise ConfigError(f"{_at(path, key)}: required")


def _show(value: Any) -> str:
    if isinstance(value, (Mapping, list, tuple)) or value is None:
        return f"{value!r} ({type(value).__name__})"
    return repr(value)


def _number(value: Any, path: str, *, minimum: float | None = None, strict: bool = False,
            maximum: float | None = None, integer: bool = False) -> Any:  # fmt: skip
    """A finite number (an int if ``integer``; an integral float such as ``1e5`` is accepted then)."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: must be {kind}, got {_show(value)}")
    if not math.isfinite(value):
        raise ConfigError(f"{path}: must be finite, got {value!r}")
    if integer:
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{path}: must be {kind}, got {value!r}")
            value = int(value)
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ConfigError(f"{path}: must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{path}: must be <= {maximum:g}, got {value!r}")
    return value


def _choice(value: Any, path: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        hint = _hint(value, choices) if isinstance(value, str) else ""
        raise ConfigError(f"{path}: must be one of {', '.join(map(repr, choices))}, got {_show(value)}{hint}")
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: must be a non-empty string, got {_show(value)}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: must be true or false, got {_show(value)}")
    return value


def _opt(m: Mapping[str, Any], key: str, default: Any, check: Callable[[Any, str], Any], path: str) -> Any:
    """``m[key]`` checked, or ``default`` when absent; an explicit null is allowed only where the
    default is None."""
    if key not in m:
        return default
    value = m[key]
    if value is None and default is None:
        return None
    return check(value, _at(path, key))


# ------------------------------------------------------------------------------------------ sections


def _parse_source(value: Any, path: str) -> tuple[SourceSpec, bool]:
    """The source and whether it set ``weight`` explicitly."""
    m = _mapping(value, path)
    if "allow_pipe" in m:
        raise ConfigError(
            f"{_at(path, 'allow_pipe')}: not a config key: 'pipe:' URLs run shell commands, so only code can allow them "
            "(build_mixture(spec, allow_pipe=True) or load_config(path, allow_pipe=True)), never a config file alone"
        )
    _keys(m, path, SOURCE_KEYS, required=("name", "urls"))
    name = _string(m["name"], _at(path, "name"))
    urls_value = m["urls"]
    urls: tuple[str, ...]
    if isinstance(urls_value, str):
        urls = (_string(urls_value, _at(path, "urls")),)
    elif isinstance(urls_value, list) and urls_value:
        urls = tuple(_string(u, _at(_at(path, "urls"), i)) for i, u in enumerate(urls_value))
    else:
        raise ConfigError(f"{_at(path, 'urls')}: must be a pattern or a non-empty list of patterns, got {_show(urls_value)}")

    def import_path(v: Any, p: str) -> str:
        if not isinstance(v, str) or not _IMPORT_PATH.match(v):
            raise ConfigError(f"{p}: must be an import path 'package.module:function', got {_show(v)}")
        return v

    def length(v: Any, p: str) -> str:
        # A field name is an identifier, an import path has a colon: the two never overlap.
        if not isinstance(v, str) or not (_IMPORT_PATH.match(v) or v.isidentifier()):
            raise ConfigError(f"{p}: must be an import path 'package.module:function' or the name of a field, got {_show(v)}")
        return v

    def options(v: Any, p: str) -> dict[str, Any]:
        return dict(_mapping(v, p))

    def io_options(v: Any, p: str) -> dict[str, Any]:
        v = _mapping(v, p)
        try:
            IOOptions.of(v)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {str(exc).removeprefix('io_options: ')}") from None
        return dict(v)

    spec = SourceSpec(
        name=name,
        urls=urls,
        weight=float(_opt(m, "weight", 1.0, lambda v, p: _number(v, p, minimum=0), path)),
        size=_opt(m, "size", None, lambda v, p: float(_number(v, p, minimum=0, strict=True)), path),
        decode=_opt(m, "decode", None, import_path, path),
        length=_opt(m, "length", None, length, path),
        on_error=_opt(m, "on_error", "raise", lambda v, p: _choice(v, p, ON_ERROR), path),
        storage_options=_opt(m, "storage_options", None, options, path),
        group=_opt(m, "group", None, _string, path),
        io_options=_opt(m, "io_options", None, io_options, path),
    )
    return spec, "weight" in m


def _parse_sources(value: Any) -> tuple[list[SourceSpec], list[bool]]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"sources: must be a non-empty list of sources, got {_show(value)}")
    specs: list[SourceSpec] = []
    explicit: list[bool] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        spec, has_weight = _parse_source(item, _at("sources", i))
        if spec.name in seen:
            raise ConfigError(f"sources[{i}].name: duplicate of sources[{seen[spec.name]}].name, got {spec.name!r}")
        seen[spec.name] = i
        specs.append(spec)
        explicit.append(has_weight)
    return specs, explicit


def _count(v: Any, p: str) -> int:
    return int(_number(v, p, minimum=1, integer=True))


def _parse_batching(value: Any) -> BatchingSpec | PackedSpec:
    path = "batching"
    m = _mapping(value, path)
    packed = _opt(m, "packed", False, _bool, path)
    for key in m:
        if packed and key not in PACKED_KEYS and key in BATCHING_KEYS:
            raise ConfigError(f"{_at(path, key)}: a TokenBudget option, not used with packed: true")
        if not packed and key not in BATCHING_KEYS and key in PACKED_KEYS:
            raise ConfigError(f"{_at(path, key)}: a Packed option; set {_at(path, 'packed')}: true to pack documents")
    if packed:
        return _parse_packed(m, path)
    _keys(m, path, BATCHING_KEYS, required=("max_tokens",))
    max_tokens = _count(m["max_tokens"], _at(path, "max_tokens"))
    max_length = _opt(m, "max_length", None, lambda v, p: _number(v, p, minimum=1, maximum=max_tokens, integer=True), path)

    def edges(v: Any, p: str) -> tuple[int, ...]:
        if not isinstance(v, list) or not v:
            raise ConfigError(f"{p}: must be a non-empty list of increasing lengths, got {_show(v)}")
        out = tuple(_count(e, _at(p, i)) for i, e in enumerate(v))
        for i in range(1, len(out)):
            if out[i] <= out[i - 1]:
                raise ConfigError(f"{_at(p, i)}: must be greater than {p}[{i - 1}] ({out[i - 1]}), got {out[i]}")
        longest = max_length if max_length is not None else max_tokens
        if out[-1] > longest:
            what = "max_length" if max_length is not None else "max_tokens"
            raise ConfigError(f"{_at(p, len(out) - 1)}: must be <= {what} ({longest}), got {out[-1]}")
        return out

    return BatchingSpec(
        max_tokens=max_tokens,
        buckets=_opt(m, "buckets", None, edges, path),
        max_batch_size=_opt(m, "max_batch_size", None, _count, path),
        multiple_of=_opt(m, "multiple_of", 1, _count, path),
        max_length=max_length,
        overlong=_opt(m, "overlong", "truncate", lambda v, p: _choice(v, p, OVERLONG), path),
        num_buckets=_opt(m, "num_buckets", None, _count, path),
        max_bucket_ratio=_opt(m, "max_bucket_ratio", None, lambda v, p: float(_number(v, p, minimum=1, strict=True)), path),
        max_wait=_opt(m, "max_wait", None, _count, path),
    )


def _parse_packed(m: Mapping[str, Any], path: str) -> PackedSpec:
    _keys(m, path, PACKED_KEYS, required=("max_tokens",))
    max_tokens = _count(m["max_tokens"], _at(path, "max_tokens"))
    seq_len = _opt(m, "seq_len", None, lambda v, p: _number(v, p, minimum=1, maximum=max_tokens, integer=True), path)
    split = _opt(m, "split_documents", False, _bool, path)
    row, what = (seq_len, "seq_len") if seq_len is not None else (max_tokens, "max_tokens")

    def max_length(v: Any, p: str) -> int:
        n = _count(v, p)
        if not split and n > row:
            # Packed's rule: a document that is never split must fit in one row.
            raise ConfigError(f"{p}: must be <= {what} ({row}) unless split_documents is true, got {n}")
        return n

    return PackedSpec(
        max_tokens=max_tokens,
        seq_len=seq_len,
        split_documents=split,
        max_length=_opt(m, "max_length", None, max_length, path),
        overlong=_opt(m, "overlong", "truncate", lambda v, p: _choice(v, p, OVERLONG), path),
        open_batches=_opt(m, "open_batches", None, _count, path),
    )


def _parse_fields(value: Any, path: str) -> dict[str, FieldSpec]:
    m = _mapping(value, path)
    if not m:
        raise ConfigError(f"{path}: must name at least one field, got {{}}")
    out: dict[str, FieldSpec] = {}
    for name, entry in m.items():
        p = _at(path, name)
        if not name.isidentifier():
            raise ConfigError(f"{p}: a field name must be an identifier, got {name!r}")
        if name in RESERVED_FIELDS or (name.endswith("_lengths") and name[: -len("_lengths")] in m):
            raise ConfigError(f"{p}: collides with a view every batch has ({', '.join(RESERVED_FIELDS)}, <field>_lengths)")
        f = _mapping(entry, p)
        _keys(f, p, FIELD_KEYS)
        dtype = _opt(f, "dtype", "int32", lambda v, q: _choice(v, q, FIELD_DTYPES), p)
        out[name] = FieldSpec(dtype=dtype, pad=_opt(f, "pad", 0, lambda v, q: _pad(v, q, dtype), p))
    return out


def _pad(value: Any, path: str, dtype: str) -> float:
    """A pad value that the field's dtype holds: exactly in an int dtype, rounded but finite (unless
    given as inf or NaN) in a float dtype."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: must be a number, got {_show(value)}")
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
        raise ConfigError(f"{path}: {value!r} is not representable as {dtype}")
    return value


def _parse_temperature(value: Any, path: str) -> tuple[Temperature, str | None]:
    """The temperature and the key that gave its length (``steps`` / ``tokens``), if any."""
    if not isinstance(value, Mapping):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return Temperature(float(_number(value, path, minimum=0, strict=True))), None
        raise ConfigError(f"{path}: must be a number or a mapping with 'start', got {_show(value)}")
    m = _mapping(value, path)
    _keys(m, path, TEMPERATURE_KEYS, required=("start",))
    start = float(_number(m["start"], _at(path, "start"), minimum=0, strict=True))
    shape = _opt(m, "shape", "constant", lambda v, p: _choice(v, p, SHAPES), path)
    base = _opt(m, "base", None, lambda v, p: _choice(v, p, BASES), path)
    if shape == "constant":
        for key in ("end", "steps", "tokens"):
            if key in m:
                raise ConfigError(f"{_at(path, key)}: only used with a non-constant shape (linear, cosine, step); shape is 'constant'")
        return Temperature(start, base=base), None
    if "end" not in m:
        raise ConfigError(f"{_at(path, 'end')}: required with shape {shape!r}")
    end = float(_number(m["end"], _at(path, "end"), minimum=0, strict=True))
    if ("steps" in m) == ("tokens" in m):
        raise ConfigError(f"{path}: shape {shape!r} needs exactly one of 'steps' or 'tokens' (its length)")
    if "steps" in m:
        steps = int(_number(m["steps"], _at(path, "steps"), minimum=1, integer=True))
        return Temperature(start, end, shape, steps=steps, base=base), "steps"
    tokens = float(_number(m["tokens"], _at(path, "tokens"), minimum=0, strict=True))
    return Temperature(start, end, shape, tokens=tokens, base=base), "tokens"


def _parse_weights(value: Any, path: str, names: Sequence[str]) -> dict[str, float]:
    m = _mapping(value, path)
    if not m:
        raise ConfigError(f"{path}: must name at least one source, got {{}}")
    out: dict[str, float] = {}
    for key, v in m.items():
        if key not in names:
            hint = _hint(key, names) or f" (sources: {', '.join(names)})"
            raise ConfigError(f"{_at(path, key)}: unknown source{hint}")
        out[key] = float(_number(v, _at(path, key), minimum=0))
    if not sum(out.values()) > 0:
        raise ConfigError(f"{path}: at least one weight must be > 0, got {out}")
    return out


def _parse_phases(value: Any, path: str, names: Sequence[str], top: Temperature | None) -> Curriculum:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{path}: must be a non-empty list of phases, got {_show(value)}")
    maps = [_mapping(v, _at(path, k)) for k, v in enumerate(value)]
    unit: str | None = None
    unit_from = ""
    for k, m in enumerate(maps):
        _keys(m, _at(path, k), PHASE_KEYS)
        for key in ("until_tokens", "until_steps", "ramp_tokens", "ramp_steps"):
            if key in m:
                u = key.split("_", 1)[1]
                if unit is None:
                    unit, unit_from = u, f"{path}[{k}].{key}"
                elif u != unit:
                    raise ConfigError(f"{_at(_at(path, k), key)}: phases count {unit} ({unit_from}); don't mix steps and tokens")
    unit = unit or "tokens"
    integer = unit == "steps"
    until_key, ramp_key = f"until_{unit}", f"ramp_{unit}"
    phases: list[Phase] = []
    previous: Any = 0
    for k, m in enumerate(maps):
        p = _at(path, k)
        last = k == len(maps) - 1
        if last and until_key in m:
            raise ConfigError(f"{_at(p, until_key)}: the last phase runs to the end of training; remove it")
        if not last and until_key not in m:
            raise ConfigError(f"{_at(p, until_key)}: required (only the last phase may omit it)")
        until = None
        if not last:
            until = _number(m[until_key], _at(p, until_key), minimum=0, strict=True, integer=integer)
            if until <= previous:
                raise ConfigError(f"{_at(p, until_key)}: must be greater than {path}[{k - 1}].{until_key} ({previous!r}), got {until!r}")
        ramp = _number(m.get(ramp_key, 0), _at(p, ramp_key), minimum=0, integer=integer)
        if ramp and k == 0:
            raise ConfigError(f"{_at(p, ramp_key)}: the first phase has nothing to ramp from; must be 0, got {ramp!r}")
        if ramp and until is not None and ramp > until - previous:
            raise ConfigError(f"{_at(p, ramp_key)}: must be <= the phase's length ({until - previous!r}), got {ramp!r}")
        weights = _opt(m, "weights", None, lambda v, q: _parse_weights(v, q, names), p)
        temperature = None
        if "temperature" in m:
            tp = _at(p, "temperature")
            temperature, length_key = _parse_temperature(m["temperature"], tp)
            if length_key is not None and length_key != unit:
                raise ConfigError(
                    f"{_at(tp, length_key)}: a phase's temperature counts from the phase's start, and these phases "
                    f"count {unit}; give its length as '{unit}'"
                )
            if temperature.base == "sizes" and weights is not None:
                raise ConfigError(f"{_at(tp, 'base')}: 'sizes' would ignore this phase's weights; use 'weights' or omit it")
        if top is not None and top.base == "sizes" and weights is not None:
            raise ConfigError(f"{path[: -len('phases')]}temperature.base: 'sizes' would ignore the weights of {p}; use 'weights' or omit it")
        phases.append(Phase(weights, until, ramp, temperature))
        if until is not None:
            previous = until
    return Curriculum(phases, unit, temperature=top)  # type: ignore[arg-type]


def _parse_schedule(value: Any, names: Sequence[str]) -> Schedule | None:
    path = "schedule"
    if value is None:
        return None
    m = _mapping(value, path)
    _keys(m, path, SCHEDULE_KEYS)
    temperature = None
    if "temperature" in m:
        temperature, _ = _parse_temperature(m["temperature"], _at(path, "temperature"))
    schedule: Schedule | None
    if "weights" in m:  # mixer.Weights: fixed weights by name, instead of the sources' own
        for other, why in (("phases", "each phase has its own weights"), ("hierarchical", "it sets the weights from sizes"),
                           ("temperature", "for a temperature over these weights, give one phase with both")):  # fmt: skip
            if other in m:
                raise ConfigError(f"{path}.weights: cannot be combined with '{other}' ({why})")
        schedule = Weights(_parse_weights(m["weights"], _at(path, "weights"), names))
    elif "phases" in m:
        if "hierarchical" in m:
            raise ConfigError(f"{path}.hierarchical: cannot be combined with 'phases'")
        schedule = _parse_phases(m["phases"], _at(path, "phases"), names, temperature)
    elif "hierarchical" in m:
        if temperature is not None:
            raise ConfigError(f"{path}.hierarchical: cannot be combined with 'temperature'")
        hp = _at(path, "hierarchical")
        h = _mapping(m["hierarchical"], hp)
        _keys(h, hp, HIERARCHICAL_KEYS, required=HIERARCHICAL_KEYS)
        schedule = Hierarchical(*(float(_number(h[k], _at(hp, k), minimum=0)) for k in HIERARCHICAL_KEYS))
    else:
        schedule = temperature
    if "min_prob" in m:
        mp = _at(path, "min_prob")
        min_prob = float(_number(m["min_prob"], mp, minimum=0, maximum=1))
        if min_prob * len(names) > 1 + 1e-12:
            raise ConfigError(f"{mp}: {min_prob!r} * {len(names)} sources = {min_prob * len(names):g} exceeds 1")
        schedule = Floored(schedule if schedule is not None else Static(), min_prob)
    return schedule


# ---------------------------------------------------------------------------------------------- NeMo


def _nemo_values(m: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """NeMo setting → (the key it was given as, value), for settings given a non-null value."""
    out: dict[str, tuple[str, Any]] = {}
    for plain, prefixed in NEMO_KEYS.items():
        given = [k for k in (plain, prefixed) if k in m and m[k] is not None]
        if len(given) == 2:
            raise ConfigError(f"{prefixed}: the same setting as '{plain}'; give only one")
        if given:
            out[plain] = (given[0], m[given[0]])
    return out


def _apply_nemo(m: Mapping[str, Any], nemo: dict[str, tuple[str, Any]], sources: list[SourceSpec],
                explicit_weight: list[bool]) -> dict[str, Any]:  # fmt: skip
    """Translate NeMo's sampling keys; returns the native settings they imply."""
    out: dict[str, Any] = {}
    if "sampling_scale" in nemo:
        key, value = nemo["sampling_scale"]
        if _number(value, key, minimum=0, strict=True) != 1:
            raise ConfigError(
                f"{key}: only 1 is supported, got {value!r}: NeMo multiplies its epoch length by it, but a mixture "
                "streams without an epoch length; bound the run in the training loop (or `mixer run --steps N`), "
                "or use stop: all_exhausted for exactly one pass over every source"
            )
    sampling = [k for k in ("sampling_technique", "sampling_temperature", "sampling_probabilities", "sampling_scale") if k in nemo]
    if not sampling:
        return out
    if "sampling_technique" in nemo:
        key, value = nemo["sampling_technique"]
        technique = _choice(value, key, NEMO_TECHNIQUES)
        given = f"{key}: {technique!r}"
    else:
        technique, given = "temperature", f"{nemo[sampling[0]][0]} (NeMo's default sampling_technique is 'temperature')"
    if "schedule" in m and m["schedule"] is not None:
        raise ConfigError(f"schedule: conflicts with {given}; NeMo's keys set the target shares, use one or the other")
    if technique != "temperature" and "sampling_temperature" in nemo:
        key = nemo["sampling_temperature"][0]
        raise ConfigError(f"{key}: only used with sampling_technique 'temperature' (NeMo ignores it with {technique!r}); remove it")
    if technique != "random" and "sampling_probabilities" in nemo:
        key = nemo["sampling_probabilities"][0]
        raise ConfigError(f"{key}: only used with sampling_technique 'random' (NeMo ignores it with {technique!r}); remove it")
    if technique == "temperature":
        t = NEMO_DEFAULT_TEMPERATURE
        if "sampling_temperature" in nemo:
            key, value = nemo["sampling_temperature"]
            t = float(_number(value, key, minimum=0, strict=True))
        out["schedule"] = Temperature(t, base="sizes")
        return out
    selector = "random" if technique == "random" else "round_robin"
    if "selector" in m and m["selector"] != selector:
        raise ConfigError(f"selector: conflicts with {given}, which means selector {selector!r}; give one")
    out["selector"] = selector
    if "sampling_probabilities" in nemo:
        key, value = nemo["sampling_probabilities"]
        if not isinstance(value, list) or len(value) != len(sources):
            raise ConfigError(f"{key}: must be a list of {len(sources)} probabilities (one per source, in order), got {_show(value)}")
        probs = [float(_number(v, _at(key, i), minimum=0)) for i, v in enumerate(value)]
        if abs(sum(probs) - 1.0) > 1e-6:
            raise ConfigError(f"{key}: must sum to 1 (as NeMo requires), got {value!r} (sum {sum(probs):g})")
        for i, has_weight in enumerate(explicit_weight):
            if has_weight:
                raise ConfigError(f"sources[{i}].weight: conflicts with {key}, which sets every source's weight")
        out["weights"] = probs
    return out


# ---------------------------------------------------------------------------------------------- API


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, plus two fixes: ``1e12`` / ``2.0e11`` are floats (YAML 1.1 wants
    ``2.0e+11``, so plain PyYAML reads them as strings), and a duplicate key is an error."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+|[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789."),
)


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The raw YAML document of a config file."""
    with open(path, encoding="utf-8") as f:
        try:
            return yaml.load(f, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise ConfigError(f"{os.fspath(path)}: not valid YAML: {exc}") from exc


def parse_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> MixtureSpec:
    """Validate a config (a mapping, or the path of a YAML file) into a :class:`MixtureSpec`,
    without listing any shard or importing ``decode``/``length``."""
    if isinstance(config, (str, os.PathLike)):
        try:
            return _parse(read_yaml(config))
        except ConfigError as exc:
            message = str(exc)
            prefix = f"{os.fspath(config)}: "
            raise ConfigError(message if message.startswith(prefix) else prefix + message) from None
    return _parse(config)


def _parse(config: Any) -> MixtureSpec:
    m = _mapping(config, "")
    _keys(m, "", ROOT_KEYS, required=("sources", "batching"))
    nemo = _nemo_values(m)
    sources, explicit_weight = _parse_sources(m["sources"])
    names = [s.name for s in sources]
    batching = _parse_batching(m["batching"])
    fields = _opt(m, "fields", None, _parse_fields, "")
    _check_fields(fields, batching, sources)
    native = _apply_nemo(m, nemo, sources, explicit_weight)
    if "weights" in native:
        sources = [SourceSpec(**{**vars(s), "weight": w}) for s, w in zip(sources, native["weights"])]
    if not any(s.weight > 0 for s in sources):
        raise ConfigError("sources: every weight is 0; at least one must be > 0")
    schedule = native["schedule"] if "schedule" in native else _parse_schedule(m.get("schedule"), names)

    seed = 0
    if "seed" in nemo:
        key, value = nemo["seed"]
        seed = int(_number(value, key, minimum=0, integer=True))
    shuffle_buffer = _opt(m, "shuffle_buffer", DEFAULT_SHUFFLE_BUFFER, lambda v, p: _number(v, p, minimum=0, integer=True), "")
    if "shuffle" in nemo:
        key, value = nemo["shuffle"]
        if not _bool(value, key):
            if "shuffle_buffer" not in m:
                shuffle_buffer = 0
            elif shuffle_buffer > 1:
                raise ConfigError(f"shuffle_buffer: conflicts with {key}: false, got {shuffle_buffer!r}")
        elif "shuffle_buffer" in m and shuffle_buffer <= 1:
            raise ConfigError(f"shuffle_buffer: {shuffle_buffer!r} does not shuffle, but {key} is true")
    return MixtureSpec(
        sources=tuple(sources),
        batching=batching,
        schedule=schedule,
        selector=native.get("selector") or _opt(m, "selector", "deficit", lambda v, p: _choice(v, p, SELECTORS), ""),
        unit=_opt(m, "unit", "tokens", lambda v, p: _choice(v, p, UNITS), ""),
        mix=_opt(m, "mix", "batch", lambda v, p: _choice(v, p, MIXES), ""),
        stop=_opt(m, "stop", "never", lambda v, p: _choice(v, p, STOPS), ""),
        seed=seed,
        shuffle_buffer=shuffle_buffer,
        pad_id=_opt(m, "pad_id", 0, lambda v, p: _number(v, p, integer=True), ""),
        dtype=_opt(m, "dtype", "int32", lambda v, p: _choice(v, p, DTYPES), ""),
        state_every=_opt(m, "state_every", DEFAULT_STATE_EVERY, _count, ""),
        fields=fields,
    )


def _check_fields(fields: Mapping[str, FieldSpec] | None, batching: BatchingSpec | PackedSpec,
                  sources: Sequence[SourceSpec]) -> None:  # fmt: skip
    """What the Mixture would refuse later: fields with packing, a source length naming no field."""
    if fields is not None and isinstance(batching, PackedSpec):
        raise ConfigError("fields: multi-field samples are batched by a token budget (padded per field), not with batching.packed: true")
    for i, s in enumerate(sources):
        if s.length is None or _IMPORT_PATH.match(s.length):
            continue
        p = f"sources[{i}].length"
        if fields is None:
            raise ConfigError(
                f"{p}: {s.length!r} names a field, but there is no 'fields' key; add fields, or give an import path "
                "'package.module:function'"
            )
        if s.length not in fields:
            hint = _hint(s.length, list(fields)) or f" (fields: {', '.join(fields)})"
            raise ConfigError(f"{p}: names no field of 'fields', got {s.length!r}{hint}")


def resolve_import(path: str, where: str) -> Callable[..., Any]:
    """``"package.module:function"`` → the function, with an error naming ``where``."""
    if not _IMPORT_PATH.match(path):
        raise ConfigError(f"{where}: must be an import path 'package.module:function', got {path!r}")
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{where}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"{where}: {path!r} is not callable, got {obj!r}")
    return obj


def build_mixture(spec: MixtureSpec, *, rank: int | None = None, world_size: int | None = None, dp_group: Any = None,
                  allow_pipe: bool = False) -> Mixture:  # fmt: skip
    """Create the sources (listing their shards) and the :class:`~mixer.Mixture` of ``spec``.
    ``rank``/``world_size``/``dp_group`` are deployment, not configuration; see ``Mixture``.
    ``allow_pipe=True`` lets every source use ``pipe:`` URLs (shell commands): code only, never a file."""
    from .budget import Field, Packed, TokenBudget
    from .mixture import Mixture
    from .source import Source

    sources = []
    for i, s in enumerate(spec.sources):
        decode = resolve_import(s.decode, f"sources[{i}].decode") if s.decode is not None else None
        length: Callable[..., Any] | str | None = s.length  # an import path, or the name of a field
        if s.length is not None and _IMPORT_PATH.match(s.length):
            length = resolve_import(s.length, f"sources[{i}].length")
        sources.append(
            Source(
                s.name, list(s.urls), weight=s.weight, size=s.size, decode=decode, length=length, on_error=s.on_error,  # type: ignore[arg-type]
                storage_options=s.storage_options, group=s.group, allow_pipe=allow_pipe, io_options=s.io_options,
            )  # fmt: skip
        )
    b = spec.batching
    batching: TokenBudget | Packed
    # None in a spec: the library's default, so only what the config set is passed.
    if isinstance(b, PackedSpec):
        extra: dict[str, Any] = {"open_batches": b.open_batches} if b.open_batches is not None else {}
        batching = Packed(
            max_tokens=b.max_tokens, seq_len=b.seq_len, split_documents=b.split_documents, max_length=b.max_length,
            overlong=b.overlong, **extra,  # type: ignore[arg-type]
        )  # fmt: skip
    else:
        extra = {k: getattr(b, k) for k in ("num_buckets", "max_bucket_ratio") if getattr(b, k) is not None}
        batching = TokenBudget(
            max_tokens=b.max_tokens, buckets=b.buckets, max_batch_size=b.max_batch_size, multiple_of=b.multiple_of,
            max_length=b.max_length, overlong=b.overlong, max_wait=b.max_wait, **extra,  # type: ignore[arg-type]
        )  # fmt: skip
    fields = {name: Field(f.dtype, pad=f.pad) for name, f in spec.fields.items()} if spec.fields is not None else None
    return Mixture(
        sources, batching=batching, schedule=spec.schedule, selector=spec.selector, unit=spec.unit,  # type: ignore[arg-type]
        mix=spec.mix, stop=spec.stop, seed=spec.seed, shuffle_buffer=spec.shuffle_buffer,  # type: ignore[arg-type]
        pad_id=spec.pad_id, dtype=spec.dtype, rank=rank, world_size=world_size, dp_group=dp_group,
        state_every=spec.state_every, fields=fields,
    )  # fmt: skip


def load_config(config: Mapping[str, Any] | str | os.PathLike[str], *, rank: int | None = None,
                world_size: int | None = None, dp_group: Any = None, allow_pipe: bool = False) -> Mixture:  # fmt: skip
    """``build_mixture(parse_config(config))``: a YAML file's path or a dict → a ready Mixture."""
    return build_mixture(parse_config(config), rank=rank, world_size=world_size, dp_group=dp_group, allow_pipe=allow_pipe)
