"""Schedules: pure functions of training progress returning the target share of every source.

A schedule is configuration (a frozen dataclass). ``probs(info, step, tokens)`` must return the same
vector on every reader of every rank for the same arguments, so it may depend only on its own fields,
on ``info`` (fixed up front, identical everywhere) and on the global progress: ``step`` (the global
batch index) and ``tokens`` (tokens seen so far). Schedules compose: a :class:`Curriculum` holds
phases with their own :class:`Temperature`, and :class:`Floored` wraps any schedule last.

Names a schedule refers to (phase weights, :class:`Weights`) are checked against ``info.names`` when
a vector is computed; :func:`check_schedule` checks every phase up front, so that a wrong name in a
late phase fails at construction and not mid-run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from functools import lru_cache
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from mixer import _check
from mixer.errors import ConfigError

__all__ = [
    "Curriculum",
    "Floored",
    "Phase",
    "Schedule",
    "SourceInfo",
    "Static",
    "Temperature",
    "Weights",
    "apply_floor",
    "check_schedule",
    "normalise",
]

Shape = Literal["constant", "linear", "cosine", "step"]
SHAPES: tuple[str, ...] = ("constant", "linear", "cosine", "step")
Base = Literal["sizes", "weights"]
BASES: tuple[str, ...] = ("sizes", "weights")
Unit = Literal["tokens", "steps"]
UNITS: tuple[str, ...] = ("tokens", "steps")


@dataclass(frozen=True, kw_only=True)
class SourceInfo:
    """What a schedule may know about the sources, in ``Mixture.sources`` order."""

    names: tuple[str, ...]
    weights: np.ndarray  # user weights, >= 0, not necessarily normalised
    sizes: np.ndarray  # tokens per source (given or estimated up front)
    groups: tuple[str | None, ...]


@runtime_checkable
class Schedule(Protocol):
    def probs(self, info: SourceInfo, step: int, tokens: float) -> np.ndarray:
        """Target share per source at global ``step`` after ``tokens`` tokens; sums to 1."""
        ...


def normalise(values: np.ndarray, *, what: str) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    total = values.sum()
    if not np.isfinite(total) or total <= 0:
        raise ConfigError(f"{what}: must have a positive finite sum (got {values.tolist()})")
    return values / total


def _sharpen(p: np.ndarray, t: float) -> np.ndarray:
    """``p_i^(1/t)`` normalised. Dividing by the largest entry first keeps one entry at exactly 1, so a
    small ``t`` cannot underflow everything to zero. Zero entries stay zero at every temperature."""
    p = np.asarray(p, dtype=np.float64)
    if t == 1.0:
        return p / p.sum()
    e = (p / p.max()) ** (1.0 / t)
    return e / e.sum()


@lru_cache(maxsize=256)
def _named_vector(names: tuple[str, ...], items: tuple[tuple[str, float], ...], what: str) -> np.ndarray:
    index = {name: i for i, name in enumerate(names)}
    vec = np.zeros(len(names))
    for name, value in items:
        if name not in index:
            raise ConfigError(f"{what}: unknown source {name!r} (sources: {', '.join(names)})")
        vec[index[name]] = value
    vec = normalise(vec, what=what)
    vec.setflags(write=False)
    return vec


def _weights_vector(weights: Mapping[str, float], names: tuple[str, ...], what: str) -> np.ndarray:
    """Per-name weights as a normalised vector in ``names`` order; names not mentioned get 0."""
    return _named_vector(names, tuple(weights.items()), what)


def _check_weights(where: str, weights: Mapping[str, float]) -> dict[str, float]:
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(f"{where}: must be a non-empty mapping of source name to weight, got {weights!r}")
    out: dict[str, float] = {}
    for name, value in weights.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: source names must be non-empty strings, got {name!r}")
        _check.number(value, f"{where}[{name!r}]", minimum=0, strict=False)
        out[name] = float(value)
    if sum(out.values()) <= 0:
        raise ConfigError(f"{where}: at least one weight must be > 0, got {out}")
    return out


@dataclass(frozen=True, kw_only=True)
class Static:
    """The sources' own weights, normalised: the default schedule."""

    def probs(self, info: SourceInfo, step: int, tokens: float) -> np.ndarray:
        return normalise(info.weights, what="source weights")


@dataclass(frozen=True)
class Weights:
    """Fixed weights by source name (normalised; sources not named get 0). Replaces the sources' own
    ``weight`` without rebuilding them. In a config file: ``schedule: {weights: {name: w, ...}}``."""

    weights: Mapping[str, float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", _check_weights("Weights.weights", self.weights))

    def probs(self, info: SourceInfo, step: int, tokens: float) -> np.ndarray:
        return np.array(_weights_vector(self.weights, info.names, "Weights.weights"))


@dataclass(frozen=True)
class Temperature:
    """``p_i ∝ b_i ** (1 / t)`` with the temperature ``t`` moving from ``start`` to ``end``.

    ``b`` is the source sizes (``base="sizes"``: the temperature sampling of multilingual MT,
    Arivazhagan et al. 2019, arXiv:1907.05019, as in NeMo's ``ConcatDataset``) or the weights
    (``base="weights"``: the same formula on the weights). ``base=None`` means sizes when the
    temperature is the whole schedule, and the phase's weights inside a :class:`Curriculum`.
    t=1 is proportional to ``b``; t→∞ tends to uniform over the sources with ``b_i > 0``; t→0 to
    the largest alone.

    ``shape`` (x = progress / length, clamped to [0, 1]; the length is ``steps`` global steps or
    ``tokens`` tokens, exactly one of them for a non-constant shape):

    - ``constant``: ``start`` throughout (``end``, ``steps`` and ``tokens`` must be unset);
    - ``linear``: ``start + (end - start) * x``;
    - ``cosine``: ``end + (start - end) * (1 + cos(pi * x)) / 2``;
    - ``step``: ``start`` until the length is reached, ``end`` from then on.

    Progress is global (from the start of training), except for a temperature given to a
    :class:`Phase`, which counts from that phase's start.
    """

    start: float
    end: float | None = None
    shape: Shape = "constant"
    _: KW_ONLY
    steps: int | None = None
    tokens: float | None = None
    base: Base | None = None

    def __post_init__(self) -> None:
        _check.number(self.start, "Temperature.start", minimum=0, strict=True)
        _check.choice(self.shape, "Temperature.shape", SHAPES)
        if self.base is not None and self.base not in BASES:
            raise ConfigError(f"Temperature.base: must be 'sizes', 'weights' or None, got {self.base!r}")
        if self.shape == "constant":
            for name in ("end", "steps", "tokens"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"Temperature.{name}: only used by a non-constant shape (shape='constant'), got "
                        f"{getattr(self, name)!r}"
                    )
            return
        if self.end is None:
            raise ConfigError(f"Temperature.end: required by shape={self.shape!r}")
        _check.number(self.end, "Temperature.end", minimum=0, strict=True)
        if (self.steps is None) == (self.tokens is None):
            raise ConfigError(
                f"Temperature: shape={self.shape!r} needs exactly one of steps or tokens, "
                f"got steps={self.steps!r}, tokens={self.tokens!r}"
            )
        if self.steps is not None:
            object.__setattr__(self, "steps", _check.number(self.steps, "Temperature.steps", minimum=1, integer=True))
        else:
            _check.number(self.tokens, "Temperature.tokens", minimum=0, strict=True)

    @property
    def unit(self) -> Unit | None:
        """What the length counts: ``"steps"``, ``"tokens"``, or None for a constant temperature."""
        return "steps" if self.steps is not None else "tokens" if self.tokens is not None else None

    def at(self, progress: float) -> float:
        """The temperature after ``progress`` (steps or tokens, per :attr:`unit`)."""
        if self.shape == "constant":
            return float(self.start)
        assert self.end is not None
        length = float(self.steps if self.steps is not None else self.tokens)  # type: ignore[arg-type]
        start, end = float(self.start), float(self.end)
        if self.shape == "step":
            return start if progress < length else end
        x = min(max(progress / length, 0.0), 1.0)
        if self.shape == "linear":
            return start + (end - start) * x
        return end + (start - end) * (1.0 + math.cos(math.pi * x)) / 2.0

    def apply(self, base: np.ndarray, progress: float) -> np.ndarray:
        """``base ** (1 / t)`` normalised, with t after ``progress``."""
        return _sharpen(base, self.at(progress))

    def progress(self, step: int, tokens: float) -> float:
        return float(step) if self.unit == "steps" else float(tokens) if self.unit == "tokens" else 0.0

    def probs(self, info: SourceInfo, step: int, tokens: float) -> np.ndarray:
        if self.base == "weights":
            base = normalise(info.weights, what="source weights")
        else:
            base = normalise(info.sizes, what="source sizes")
        return self.apply(base, self.progress(step, tokens))


@dataclass(frozen=True)
class Phase:
    """One stage of a :class:`Curriculum`, in force until ``until`` (steps or tokens, per the
    curriculum's unit; None for the last phase).

    ``weights`` names sources (those not named get 0); None means the sources' own weights.
    Entering the phase, the target moves linearly from the previous phase's vector to this one's
    over ``ramp`` (same unit) so that the schedule is continuous at the boundary (no sudden change
    of the data distribution).
    ``temperature`` reshapes this phase's weights, counting its progress from the phase's start.
    """

    weights: Mapping[str, float] | None = None
    until: float | None = None
    ramp: float = 0
    temperature: Temperature | None = None

    def __post_init__(self) -> None:
        if self.weights is not None:
            object.__setattr__(self, "weights", _check_weights("Phase.weights", self.weights))
        _check.optional(self.until, _check.number, "Phase.until", minimum=0, strict=True)
        _check.number(self.ramp, "Phase.ramp", minimum=0, strict=False)
        if self.temperature is not None and not isinstance(self.temperature, Temperature):
            raise ConfigError(f"Phase.temperature: must be a Temperature or None, got {self.temperature!r}")
        if self.temperature is not None and self.temperature.base == "sizes" and self.weights is not None:
            raise ConfigError(
                "Phase.temperature.base: 'sizes' would ignore this phase's weights; use 'weights' or None"
            )


@dataclass(frozen=True)
class Curriculum:
    """Phases of target weights over training (a data curriculum), by ``unit`` (``"tokens"`` seen or
    global ``"steps"``).

    Phase k runs from the previous phase's ``until`` (0 for the first) up to, not including, its own
    ``until``. In the first ``ramp`` of phase k the target is ``(1 - a) * v[k-1] + a * v[k]`` with
    ``a = (x - start_k) / ramp``, so the schedule is continuous at the boundary; a ramp may not be
    longer than its phase, and the first phase has nothing to ramp from.

    A phase's vector ``v[k]`` is its weights (or the sources' weights), reshaped by the phase's own
    temperature (progress from the phase's start, in the curriculum's unit) or else by the
    curriculum-wide ``temperature`` (progress from the start of training, in its own unit).
    """

    phases: Sequence[Phase]
    unit: Unit = "tokens"
    _: KW_ONLY
    temperature: Temperature | None = None

    def __post_init__(self) -> None:
        phases = tuple(self.phases) if isinstance(self.phases, Sequence) and not isinstance(self.phases, str) else None
        if not phases:
            raise ConfigError(f"Curriculum.phases: must be a non-empty sequence of Phase, got {self.phases!r}")
        object.__setattr__(self, "phases", phases)
        if self.unit not in UNITS:
            raise ConfigError(f"Curriculum.unit: must be 'tokens' or 'steps', got {self.unit!r}")
        if self.temperature is not None and not isinstance(self.temperature, Temperature):
            raise ConfigError(f"Curriculum.temperature: must be a Temperature or None, got {self.temperature!r}")
        previous = 0.0
        for k, phase in enumerate(phases):
            where = f"Curriculum.phases[{k}]"
            if not isinstance(phase, Phase):
                raise ConfigError(f"{where}: must be a Phase, got {phase!r}")
            last = k == len(phases) - 1
            if last and phase.until is not None:
                raise ConfigError(
                    f"{where}.until: the last phase runs to the end of training; must be None, got {phase.until!r}"
                )
            if not last and phase.until is None:
                raise ConfigError(f"{where}.until: required (only the last phase has until=None)")
            if not last and phase.until <= previous:  # type: ignore[operator]
                raise ConfigError(
                    f"{where}.until: must be greater than the previous boundary {previous:g}, got {phase.until!r}"
                )
            if k == 0 and phase.ramp > 0:
                raise ConfigError(
                    f"{where}.ramp: the first phase has nothing to ramp from; must be 0, got {phase.ramp!r}"
                )
            if not last and phase.ramp > phase.until - previous:  # type: ignore[operator]
                raise ConfigError(
                    f"{where}.ramp: longer than the phase ({phase.until - previous:g} {self.unit}), got {phase.ramp!r}"  # type: ignore[operator]
                )
            t = phase.temperature
            if t is not None and t.unit is not None and t.unit != self.unit:
                raise ConfigError(
                    f"{where}.temperature: counts {t.unit} from the phase's start, but this curriculum counts "
                    f"{self.unit}; give its length in {self.unit}"
                )
            if self.temperature is not None and self.temperature.base == "sizes" and phase.weights is not None:
                raise ConfigError(
                    f"Curriculum.temperature.base: 'sizes' would ignore the weights of phases[{k}]; use 'weights' or "
                    "None"
                )
            if not last:
                previous = float(phase.until)  # type: ignore[arg-type]

    def start(self, k: int) -> float:
        """Where phase ``k`` starts, in the curriculum's unit."""
        return 0.0 if k == 0 else float(self.phases[k - 1].until)  # type: ignore[arg-type]

    def phase_at(self, x: float) -> int:
        """The index of the phase in force at progress ``x`` (a boundary belongs to the next phase)."""
        for k, phase in enumerate(self.phases):
            if phase.until is None or x < phase.until:
                return k
        raise AssertionError("the last phase has until=None")

    def _vector(self, k: int, info: SourceInfo, step: int, tokens: float, x: float) -> np.ndarray:
        phase = self.phases[k]
        t = phase.temperature
        if phase.weights is not None:
            base = _weights_vector(phase.weights, info.names, f"Curriculum.phases[{k}].weights")
        elif t is not None and t.base == "sizes":
            base = normalise(info.sizes, what="source sizes")
        else:
            base = normalise(info.weights, what="source weights")
        if t is not None:
            return t.apply(base, x - self.start(k))
        if self.temperature is not None:
            if phase.weights is None and self.temperature.base == "sizes":
                base = normalise(info.sizes, what="source sizes")
            return self.temperature.apply(base, self.temperature.progress(step, tokens))
        return base

    def check(self, info: SourceInfo) -> None:
        """Compute every phase's vector once (names, sums), as :func:`check_schedule` does."""
        for k in range(len(self.phases)):
            self._vector(k, info, 0, 0.0, self.start(k))

    def probs(self, info: SourceInfo, step: int, tokens: float) -> np.ndarray:
        x = float(tokens) if self.unit == "tokens" else float(step)
        k = self.phase_at(x)
        current = self._vector(k, info, step, tokens, x)
        ramp = float(self.phases[k].ramp)
        start = self.start(k)
        if k == 0 or ramp == 0 or x >= start + ramp:
            return np.array(current)
        a = (x - start) / ramp
        previous = self._vector(k - 1, info, step, tokens, x)
        return (1.0 - a) * previous + a * current


def apply_floor(p: np.ndarray, eligible: np.ndarray, min_prob: float) -> np.ndarray:
    """Raise every eligible entry below ``min_prob`` to exactly ``min_prob`` and scale the others
    down so that the total stays 1; repeat until no scaled entry falls below the floor (at most
    ``len(p)`` rounds). Needs ``min_prob * eligible.sum() <= 1``."""
    p = np.asarray(p, dtype=np.float64)
    eligible = np.asarray(eligible, dtype=bool)
    floored = np.zeros(len(p), dtype=bool)
    q = p.copy()
    while True:
        low = eligible & ~floored & (q < min_prob)
        if not low.any():
            return q
        floored |= low
        mass = max(1.0 - min_prob * floored.sum(), 0.0)
        rest = p[~floored].sum()
        if rest > 0:
            q = np.where(floored, min_prob, p * (mass / rest))
        else:
            # Only unreachable-by-floor mass is left (e.g. every eligible source is floored): share it.
            q = np.where(floored, min_prob + mass / floored.sum(), 0.0)


@dataclass(frozen=True)
class Floored:
    """Guarantees every source of nonzero size at least ``min_prob`` (no source starves), applied
    after ``schedule`` and renormalised exactly (see :func:`apply_floor`). It also
    lifts sources the schedule gives 0; remove a source from the mixture to exclude it."""

    schedule: Schedule
    min_prob: float

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, Schedule):
            raise ConfigError(f"Floored.schedule: must be a schedule (with probs()), got {self.schedule!r}")
        _check.number(self.min_prob, "Floored.min_prob", minimum=0, maximum=1)

    def check(self, info: SourceInfo) -> None:
        check = getattr(self.schedule, "check", None)
        if callable(check):
            check(info)

    def probs(self, info: SourceInfo, step: int, tokens: float) -> np.ndarray:
        eligible = np.asarray(info.sizes) > 0
        n = int(eligible.sum())
        if self.min_prob * n > 1 + 1e-12:
            raise ConfigError(f"Floored.min_prob: {self.min_prob!r} * {n} sources = {self.min_prob * n:g} exceeds 1")
        return apply_floor(self.schedule.probs(info, step, tokens), eligible, float(self.min_prob))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def describe_schedule(schedule: Schedule) -> str:
    """How a schedule enters the mixture's fingerprint: its ``describe()`` when it has one, else its
    ``repr`` (the built-in schedules are frozen dataclasses: their repr is their configuration). A
    text that holds an object's address (the default ``repr`` of a class, or of a function inside a
    schedule) would differ in every process and refuse every resume as "a different mixture", so it is
    refused here, when the mixture is built."""
    describe = getattr(schedule, "describe", None)
    text = describe() if callable(describe) else repr(schedule)
    if not isinstance(text, str):
        raise ConfigError(
            f"schedule {type(schedule).__qualname__}: describe() must return a str (got {type(text).__name__})"
        )
    if _ADDRESS.search(text):
        raise ConfigError(
            f"schedule {type(schedule).__qualname__}: its description {text!r} holds an object address, which differs "
            "in every process, so no state could ever resume; give the schedule (or the object inside it) a describe() "
            "returning a str, or a __repr__, that names its configuration"
        )
    return text


def check_schedule(schedule: Schedule, info: SourceInfo) -> np.ndarray:
    """Check ``schedule`` against the sources before training: its ``check(info)`` if it has one
    (a :class:`Curriculum` computes every phase, so a wrong name in a late phase fails now and not
    mid-run), then the vector at the start of training. Returns that initial vector."""
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"schedule: must have probs(info, step, tokens), got {schedule!r}")
    check = getattr(schedule, "check", None)
    if callable(check):
        check(info)
    p = np.asarray(schedule.probs(info, 0, 0.0), dtype=np.float64)
    n = len(info.names)
    if p.shape != (n,) or not np.all(np.isfinite(p)) or np.any(p < 0) or abs(p.sum() - 1.0) > 1e-9:
        raise ConfigError(f"schedule {schedule!r}: probs must be {n} finite shares >= 0 summing to 1, got {p.tolist()}")
    return p
