"""The schedule's config form: the ``schedule`` keys of a config file → :mod:`mixer.mixing.schedule`
objects (:func:`parse_schedule`), and back (:func:`schedule_to_dict`). Errors name the key path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mixer import _check
from mixer.errors import ConfigError
from mixer.mixing.adaptive import Adaptive, make_policy
from mixer.mixing.hierarchical import Hierarchical
from mixer.mixing.schedule import BASES, SHAPES, Curriculum, Floored, Phase, Schedule, Static, Temperature, Weights

SCHEDULE_KEYS = ("weights", "temperature", "phases", "hierarchical", "min_prob", "adaptive")
ADAPTIVE_KEYS = ("policy", "lr", "update_every", "smoothing", "lag", "reference")
TEMPERATURE_KEYS = ("start", "end", "shape", "steps", "tokens", "base")
PHASE_KEYS = ("weights", "until_tokens", "until_steps", "ramp_tokens", "ramp_steps", "temperature")
HIERARCHICAL_KEYS = ("beta_group", "beta_source")


def _temperature_to_dict(t: Temperature) -> dict[str, Any]:
    out: dict[str, Any] = {"start": t.start}
    if t.shape != "constant":
        out.update(end=t.end, shape=t.shape)
        out["steps" if t.steps is not None else "tokens"] = t.steps if t.steps is not None else t.tokens
    if t.base is not None:
        out["base"] = t.base
    return out


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    if isinstance(schedule, Adaptive):
        a: dict[str, Any] = {
            "policy": schedule.policy,
            "lr": schedule.lr,
            "update_every": schedule.update_every,
            "smoothing": schedule.smoothing,
        }
        if schedule.lag is not None:
            a["lag"] = schedule.lag
        if schedule.reference is not None:
            a["reference"] = dict(schedule.reference)
        return {**schedule_to_dict(schedule.schedule), "adaptive": a}
    if isinstance(schedule, Floored):
        return {**schedule_to_dict(schedule.schedule), "min_prob": schedule.min_prob}
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
    raise ConfigError(
        f"schedule: {schedule!r} has no config form (only Weights, Temperature, Curriculum, Hierarchical, Floored, "
        "Static, Adaptive)"
    )


def _parse_temperature(value: Any, path: str) -> tuple[Temperature, str | None]:
    """The temperature and the key that gave its length (``steps`` / ``tokens``), if any."""
    if not isinstance(value, Mapping):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return Temperature(float(_check.number(value, path, minimum=0, strict=True))), None
        raise ConfigError(f"{path}: must be a number or a mapping with 'start', got {_check.show(value)}")
    m = _check.mapping(value, path)
    _check.keys(m, path, TEMPERATURE_KEYS, required=("start",))
    start = float(_check.number(m["start"], _check.at(path, "start"), minimum=0, strict=True))
    shape = _check.entry(m, "shape", "constant", lambda v, p: _check.choice(v, p, SHAPES), path)
    base = _check.entry(m, "base", None, lambda v, p: _check.choice(v, p, BASES), path)
    if shape == "constant":
        for key in ("end", "steps", "tokens"):
            if key in m:
                raise ConfigError(
                    f"{_check.at(path, key)}: only used with a non-constant shape (linear, cosine, step); shape is "
                    "'constant'"
                )
        return Temperature(start, base=base), None
    if "end" not in m:
        raise ConfigError(f"{_check.at(path, 'end')}: required with shape {shape!r}")
    end = float(_check.number(m["end"], _check.at(path, "end"), minimum=0, strict=True))
    if ("steps" in m) == ("tokens" in m):
        raise ConfigError(f"{path}: shape {shape!r} needs exactly one of 'steps' or 'tokens' (its length)")
    if "steps" in m:
        steps = int(_check.number(m["steps"], _check.at(path, "steps"), minimum=1, integer=True))
        return Temperature(start, end, shape, steps=steps, base=base), "steps"
    tokens = float(_check.number(m["tokens"], _check.at(path, "tokens"), minimum=0, strict=True))
    return Temperature(start, end, shape, tokens=tokens, base=base), "tokens"


def _parse_weights(value: Any, path: str, names: Sequence[str]) -> dict[str, float]:
    m = _check.mapping(value, path)
    if not m:
        raise ConfigError(f"{path}: must name at least one source, got {{}}")
    out: dict[str, float] = {}
    for key, v in m.items():
        if key not in names:
            hint = _check.hint(key, names) or f" (sources: {', '.join(names)})"
            raise ConfigError(f"{_check.at(path, key)}: unknown source{hint}")
        out[key] = float(_check.number(v, _check.at(path, key), minimum=0))
    if not sum(out.values()) > 0:
        raise ConfigError(f"{path}: at least one weight must be > 0, got {out}")
    return out


def _parse_phases(value: Any, path: str, names: Sequence[str], top: Temperature | None) -> Curriculum:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{path}: must be a non-empty list of phases, got {_check.show(value)}")
    maps = [_check.mapping(v, _check.at(path, k)) for k, v in enumerate(value)]
    unit: str | None = None
    unit_from = ""
    for k, m in enumerate(maps):
        _check.keys(m, _check.at(path, k), PHASE_KEYS)
        for key in ("until_tokens", "until_steps", "ramp_tokens", "ramp_steps"):
            if key in m:
                u = key.split("_", 1)[1]
                if unit is None:
                    unit, unit_from = u, f"{path}[{k}].{key}"
                elif u != unit:
                    raise ConfigError(
                        f"{_check.at(_check.at(path, k), key)}: phases count {unit} ({unit_from}); don't mix steps "
                        "and tokens"
                    )
    unit = unit or "tokens"
    integer = unit == "steps"
    until_key, ramp_key = f"until_{unit}", f"ramp_{unit}"
    phases: list[Phase] = []
    previous: Any = 0
    for k, m in enumerate(maps):
        p = _check.at(path, k)
        last = k == len(maps) - 1
        if last and until_key in m:
            raise ConfigError(f"{_check.at(p, until_key)}: the last phase runs to the end of training; remove it")
        if not last and until_key not in m:
            raise ConfigError(f"{_check.at(p, until_key)}: required (only the last phase may omit it)")
        until = None
        if not last:
            until = _check.number(m[until_key], _check.at(p, until_key), minimum=0, strict=True, integer=integer)
            if until <= previous:
                raise ConfigError(
                    f"{_check.at(p, until_key)}: must be greater than {path}[{k - 1}].{until_key} ({previous!r}), got "
                    f"{until!r}"
                )
        ramp = _check.number(m.get(ramp_key, 0), _check.at(p, ramp_key), minimum=0, integer=integer)
        if ramp and k == 0:
            raise ConfigError(
                f"{_check.at(p, ramp_key)}: the first phase has nothing to ramp from; must be 0, got {ramp!r}"
            )
        if ramp and until is not None and ramp > until - previous:
            raise ConfigError(
                f"{_check.at(p, ramp_key)}: must be <= the phase's length ({until - previous!r}), got {ramp!r}"
            )
        weights = _check.entry(m, "weights", None, lambda v, q: _parse_weights(v, q, names), p)
        temperature = None
        if "temperature" in m:
            tp = _check.at(p, "temperature")
            temperature, length_key = _parse_temperature(m["temperature"], tp)
            if length_key is not None and length_key != unit:
                raise ConfigError(
                    f"{_check.at(tp, length_key)}: a phase's temperature counts from the phase's start, and these "
                    f"phases count {unit}; give its length as '{unit}'"
                )
            if temperature.base == "sizes" and weights is not None:
                raise ConfigError(
                    f"{_check.at(tp, 'base')}: 'sizes' would ignore this phase's weights; use 'weights' or omit it"
                )
        if top is not None and top.base == "sizes" and weights is not None:
            raise ConfigError(
                f"{path[: -len('phases')]}temperature.base: 'sizes' would ignore the weights of {p}; use 'weights' or "
                "omit it"
            )
        phases.append(Phase(weights, until, ramp, temperature))
        if until is not None:
            previous = until
    return Curriculum(phases, unit, temperature=top)  # type: ignore[arg-type]


def parse_schedule(value: Any, names: Sequence[str]) -> Schedule | None:
    path = "schedule"
    if value is None:
        return None
    m = _check.mapping(value, path)
    _check.keys(m, path, SCHEDULE_KEYS)
    temperature = None
    if "temperature" in m:
        temperature, _ = _parse_temperature(m["temperature"], _check.at(path, "temperature"))
    schedule: Schedule | None
    if "weights" in m:  # mixer.Weights: fixed weights by name, instead of the sources' own
        for other, why in (
            ("phases", "each phase has its own weights"),
            ("hierarchical", "it sets the weights from sizes"),
            ("temperature", "for a temperature over these weights, give one phase with both"),
        ):
            if other in m:
                raise ConfigError(f"{path}.weights: cannot be combined with '{other}' ({why})")
        schedule = Weights(_parse_weights(m["weights"], _check.at(path, "weights"), names))
    elif "phases" in m:
        if "hierarchical" in m:
            raise ConfigError(f"{path}.hierarchical: cannot be combined with 'phases'")
        schedule = _parse_phases(m["phases"], _check.at(path, "phases"), names, temperature)
    elif "hierarchical" in m:
        if temperature is not None:
            raise ConfigError(f"{path}.hierarchical: cannot be combined with 'temperature'")
        hp = _check.at(path, "hierarchical")
        h = _check.mapping(m["hierarchical"], hp)
        _check.keys(h, hp, HIERARCHICAL_KEYS, required=HIERARCHICAL_KEYS)
        schedule = Hierarchical(*(float(_check.number(h[k], _check.at(hp, k), minimum=0)) for k in HIERARCHICAL_KEYS))
    else:
        schedule = temperature
    if "min_prob" in m:
        mp = _check.at(path, "min_prob")
        min_prob = float(_check.number(m["min_prob"], mp, minimum=0, maximum=1))
        if min_prob * len(names) > 1 + 1e-12:
            raise ConfigError(f"{mp}: {min_prob!r} * {len(names)} sources = {min_prob * len(names):g} exceeds 1")
        schedule = Floored(schedule if schedule is not None else Static(), min_prob)
    if "adaptive" in m:
        schedule = _parse_adaptive(m["adaptive"], _check.at(path, "adaptive"), names, schedule)
    return schedule


def _parse_adaptive(value: Any, path: str, names: Sequence[str], prior: Schedule | None) -> Adaptive:
    a = _check.mapping(value, path)
    _check.keys(a, path, ADAPTIVE_KEYS)
    try:
        adaptive = Adaptive(prior if prior is not None else Static(), **dict(a))
        make_policy(adaptive, names)  # the reference's source names
    except ConfigError as exc:
        raise _check.relabel(exc, "Adaptive", path) from None
    return adaptive
