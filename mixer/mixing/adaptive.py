"""Feedback-driven targets: policies that move the schedule's shares toward the sources the model
still has most to learn from.

A policy sees, once per update window, the per-source loss *sums* and sample *counts* of that window
(reduced over every rank before it is called), the *prior* (the configured schedule's target at the
update step) and the shares *current* during the window, and returns new shares. The update is a
pure function of those arguments and the policy's own state, so every rank that calls it with the
same reduced statistics computes the same vector. ``min_prob`` floors are applied after the policy
(:func:`adapt`), as they are after any schedule.

A source with no sample in a window (count 0: exhausted, floored to nothing, or just unlucky) keeps
its weight: the policy has learnt nothing about it.

- :class:`ExpGradient`: exponentiated-gradient reweighting on excess loss, the online form of DoReMi
  (Xie et al. 2023, `arXiv:2305.10429 <https://arxiv.org/abs/2305.10429>`_):
  ``w_i ∝ w_i · exp(lr · excess_i)`` with ``excess_i = max(mean_loss_i - reference_i, 0)``; the
  reference is a given loss per source, or the source's own lowest window mean so far. The result
  is smoothed toward the prior: ``(1 - smoothing) · w + smoothing · prior``.
- :class:`Exp3`: the EXP3 bandit of Online Data Mixing (Albalak et al. 2023,
  `arXiv:2312.02406 <https://arxiv.org/abs/2312.02406>`_): the mean loss is the reward, divided by
  the share the source was sampled at (importance weighting), accumulated in a score ``s_i``;
  shares ``(1 - smoothing) · prior_i · exp(s_i) / Σ prior_j · exp(s_j) + smoothing · prior_i``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from mixer import _check
from mixer.errors import ConfigError, StateError
from mixer.mixing.schedule import Floored, Schedule, SourceInfo, Static, apply_floor
from mixer.state.checkpoint import expect_keys

__all__ = ["Adaptive", "Exp3", "ExpGradient", "Policy", "adapt", "make_policy", "POLICIES"]

PolicyName = Literal["exp_gradient", "exp3"]
POLICIES: tuple[str, ...] = ("exp_gradient", "exp3")


@runtime_checkable
class Policy(Protocol):
    def update(self, sums: np.ndarray, counts: np.ndarray, prior: np.ndarray, current: np.ndarray) -> np.ndarray:
        """New shares (summing to 1) after a window with these per-source loss ``sums`` and sample
        ``counts``; ``prior`` is the schedule's target now, ``current`` the shares sampled at."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Adaptive:
    """Feedback-driven mixing over a prior ``schedule`` (``schedule: {adaptive: {...}}`` in a config
    file). As a schedule it returns the prior's shares; a loader over a mixture with this schedule
    takes per-source loss through ``Loader.feedback`` and, every ``update_every`` global steps, lets
    the ``policy`` compute new shares from the window's losses, the policy's state and the prior's
    target at that step. They take effect ``lag`` steps later (default: the least that no reader
    can have reached yet; see :mod:`mixer.runtime.feedback`), on every reader at the same global step.
    A :class:`~mixer.Floored` prior's ``min_prob`` applies to the adaptive shares too, last.
    ``reference`` (``exp_gradient`` only): a reference loss per source name; without it the excess
    is measured against each source's own lowest window mean.
    """

    schedule: Schedule = field(default_factory=Static)
    _: KW_ONLY
    policy: PolicyName = "exp_gradient"
    lr: float = 1.0
    update_every: int = 100
    smoothing: float = 0.1
    lag: int | None = None
    reference: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, Schedule) or isinstance(self.schedule, Adaptive):
            raise ConfigError(f"Adaptive.schedule: must be a (non-adaptive) schedule, got {self.schedule!r}")
        _check.choice(self.policy, "Adaptive.policy", POLICIES)
        _check.number(self.lr, "Adaptive.lr", minimum=0)
        _check.count(self.update_every, "Adaptive.update_every")
        _check.number(self.smoothing, "Adaptive.smoothing", minimum=0, maximum=1)
        _check.optional(self.lag, _check.number, "Adaptive.lag", minimum=0, integer=True)
        if self.reference is not None:
            _check.mapping(self.reference, "Adaptive.reference")
            if self.policy != "exp_gradient":
                raise ConfigError(f"Adaptive.reference: only for policy 'exp_gradient' (got policy {self.policy!r})")
            for name, value in self.reference.items():
                _check.number(value, _check.at("Adaptive.reference", name))

    @property
    def min_prob(self) -> float:
        return float(self.schedule.min_prob) if isinstance(self.schedule, Floored) else 0.0

    def check(self, info: SourceInfo) -> None:
        check = getattr(self.schedule, "check", None)
        if callable(check):
            check(info)
        make_policy(self, info.names)  # the reference's names

    def probs(self, info: SourceInfo, step: int, tokens: float) -> np.ndarray:
        return self.schedule.probs(info, step, tokens)


def make_policy(config: Adaptive, names: Sequence[str]) -> Policy:
    """The policy ``config`` names, for sources ``names`` (in mixture order)."""
    if config.policy == "exp3":
        return Exp3(len(names), lr=float(config.lr), smoothing=float(config.smoothing))
    reference = None
    if config.reference is not None:
        unknown = sorted(set(config.reference) - set(names))
        if unknown:
            raise ConfigError(f"Adaptive.reference: unknown source {unknown[0]!r} (sources: {', '.join(names)})")
        reference = [float(config.reference[n]) if n in config.reference else None for n in names]
    return ExpGradient(len(names), lr=float(config.lr), smoothing=float(config.smoothing), reference=reference)


def _means(sums: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sums = np.asarray(sums, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    seen = counts > 0
    return np.where(seen, sums / np.where(seen, counts, 1.0), 0.0), seen


def _floats(state: dict[str, Any], key: str, n: int, part: str, *, nullable: bool = False) -> list[Any]:
    value = state[key]
    if (
        not isinstance(value, list)
        or len(value) != n
        or not all((nullable and v is None) or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in value)
    ):
        raise StateError(f"{part} state: {key!r} must be a list of {n} numbers (got {value!r})")
    return [None if v is None else float(v) for v in value]


class ExpGradient:
    """Online DoReMi (see the module docstring). State: the weights (None before the first update,
    which starts from the prior) and each source's lowest window mean loss."""

    def __init__(self, n: int, *, lr: float, smoothing: float, reference: Sequence[float | None] | None = None):
        self.n, self.lr, self.smoothing = n, lr, smoothing
        self.reference = None if reference is None else list(reference)
        self.weights: np.ndarray | None = None
        self.minimum: list[float | None] = [None] * n

    def update(self, sums: np.ndarray, counts: np.ndarray, prior: np.ndarray, current: np.ndarray) -> np.ndarray:
        mean, seen = _means(sums, counts)
        prior = np.asarray(prior, dtype=np.float64)
        w = prior.copy() if self.weights is None else self.weights
        excess = np.zeros(self.n)
        for i in np.flatnonzero(seen):
            ref = self.reference[i] if self.reference is not None else None
            ref = self.minimum[i] if ref is None else ref
            excess[i] = max(mean[i] - ref, 0.0) if ref is not None else 0.0
            low = self.minimum[i]
            self.minimum[i] = float(mean[i]) if low is None else min(low, float(mean[i]))
        # The sources seen in the window share out their own mass; an unseen one keeps its weight.
        mass = float(w[seen].sum())
        new = w.copy()
        if mass > 0:
            raised = w[seen] * np.exp(self.lr * (excess[seen] - excess[seen].max()))
            raised = raised * (mass / raised.sum())
            p_seen = float(prior[seen].sum())
            toward = prior[seen] * (mass / p_seen) if p_seen > 0 else raised
            new[seen] = (1.0 - self.smoothing) * raised + self.smoothing * toward
        self.weights = new
        # Sums to 1 up to rounding already (mass preserved); no division, so that an unseen
        # source's share stays bit for bit what it was.
        return new.copy()

    def state_dict(self) -> dict[str, Any]:
        return {"weights": None if self.weights is None else self.weights.tolist(), "minimum": list(self.minimum)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = expect_keys("ExpGradient", state, ("weights", "minimum"))
        weights = None if state["weights"] is None else np.array(_floats(state, "weights", self.n, "ExpGradient"))
        self.minimum = _floats(state, "minimum", self.n, "ExpGradient", nullable=True)
        self.weights = weights


class Exp3:
    """EXP3 as in Online Data Mixing (see the module docstring). State: the score per source."""

    def __init__(self, n: int, *, lr: float, smoothing: float):
        self.n, self.lr, self.smoothing = n, lr, smoothing
        self.scores = np.zeros(n)

    def update(self, sums: np.ndarray, counts: np.ndarray, prior: np.ndarray, current: np.ndarray) -> np.ndarray:
        mean, seen = _means(sums, counts)
        current = np.asarray(current, dtype=np.float64)
        # A source seen in the window was sampled at a positive share (no division by zero).
        self.scores[seen] += self.lr * mean[seen] / current[seen]
        return self.shares(prior)

    def shares(self, prior: np.ndarray) -> np.ndarray:
        prior = np.asarray(prior, dtype=np.float64)
        e = prior * np.exp(self.scores - self.scores[prior > 0].max(initial=0.0))
        return (1.0 - self.smoothing) * e / e.sum() + self.smoothing * prior

    def state_dict(self) -> dict[str, Any]:
        return {"scores": self.scores.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = expect_keys("Exp3", state, ("scores",))
        self.scores = np.array(_floats(state, "scores", self.n, "Exp3"))


def adapt(
    policy: Policy,
    sums: np.ndarray,
    counts: np.ndarray,
    prior: np.ndarray,
    current: np.ndarray,
    *,
    eligible: np.ndarray,
    min_prob: float,
) -> np.ndarray:
    """The policy's new shares with the ``min_prob`` floor applied last (:func:`~mixer.mixing.schedule.apply_floor`)."""
    p = policy.update(sums, counts, prior, current)
    return apply_floor(p, eligible, min_prob) if min_prob > 0 else p
