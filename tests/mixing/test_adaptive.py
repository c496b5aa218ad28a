"""Adaptive policies: update rules against hand-computed values, unseen sources, state round trips."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from mixer.errors import ConfigError, StateError
from mixer.mixing.adaptive import Adaptive, Exp3, ExpGradient, adapt, make_policy

PRIOR = np.array([0.5, 0.3, 0.2])


def close(a, b):
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=0, atol=1e-12)


def test_exp_gradient_running_minimum_two_updates():
    eg = ExpGradient(3, lr=1.0, smoothing=0.2)
    # Window 1: means (2, 1.5, -); no minimum yet, so no excess: the weights stay the prior, and
    # smoothing toward the prior leaves them there.
    close(eg.update(np.array([2.0, 3.0, 0.0]), np.array([1, 2, 0]), PRIOR, PRIOR), PRIOR)
    assert eg.minimum == [2.0, 1.5, None]
    # Window 2: means (2.5, 1.0, 1.0); excess (0.5, 0 (below its minimum), 0 (first window)).
    # w ∝ (0.5 e^0.5, 0.3, 0.2) over a total of 0.5 e^0.5 + 0.5; then 0.8 · that + 0.2 · prior.
    e = math.exp(0.5)
    z = 0.5 * e + 0.5
    expected = [0.8 * 0.5 * e / z + 0.1, 0.8 * 0.3 / z + 0.06, 0.8 * 0.2 / z + 0.04]
    close(eg.update(np.array([5.0, 3.0, 1.0]), np.array([2, 3, 1]), PRIOR, PRIOR), expected)
    assert eg.minimum == [2.0, 1.0, 1.0]


def test_exp_gradient_against_a_reference_loss():
    eg = ExpGradient(3, lr=2.0, smoothing=0.0, reference=[1.0, None, 0.5])
    # Means (1.5, 2, 0.25): excess (0.5, 0 (own minimum, first window), 0 (below the reference, clipped)).
    e = math.exp(2.0 * 0.5)
    z = 0.5 * e + 0.5
    close(eg.update(np.array([3.0, 2.0, 0.5]), np.array([2, 1, 2]), PRIOR, PRIOR), [0.5 * e / z, 0.3 / z, 0.2 / z])


def test_exp_gradient_unseen_source_keeps_its_weight():
    eg = ExpGradient(3, lr=1.0, smoothing=0.5, reference=[1.0, 1.0, 1.0])
    # Source 2 has no sample: it keeps 0.2; sources 0 and 1 share out their 0.8. Means (2, 1):
    # excess (1, 0): raised ∝ (0.5 e, 0.3) scaled to 0.8; half of it, half the prior's (0.5, 0.3).
    e = math.e
    raised = [0.5 * e * 0.8 / (0.5 * e + 0.3), 0.3 * 0.8 / (0.5 * e + 0.3)]
    p = eg.update(np.array([4.0, 1.0, 0.0]), np.array([2, 1, 0]), PRIOR, PRIOR)
    close(p, [0.5 * raised[0] + 0.25, 0.5 * raised[1] + 0.15, 0.2])
    assert p[2] == 0.2


def test_exp3_two_updates_importance_weighted():
    prior = np.array([0.5, 0.5])
    b = Exp3(2, lr=0.1, smoothing=0.2)
    # Means (2, 1) sampled at ½ each: scores 0.1 · 2 / 0.5 = 0.4 and 0.1 · 1 / 0.5 = 0.2.
    p1 = b.update(np.array([4.0, 2.0]), np.array([2, 2]), prior, prior)
    z = math.exp(0.4) + math.exp(0.2)
    close(p1, [0.8 * math.exp(0.4) / z + 0.1, 0.8 * math.exp(0.2) / z + 0.1])
    close(b.scores, [0.4, 0.2])
    # Window 2: only source 1 (mean 1, sampled at p1[1]); source 0's score stays 0.4.
    b.update(np.array([0.0, 3.0]), np.array([0, 3]), prior, p1)
    close(b.scores, [0.4, 0.2 + 0.1 / p1[1]])


def test_floor_applies_last():
    b = Exp3(2, lr=10.0, smoothing=0.0)
    # Scores (20, 0): shares (1/(1+e^-20), e^-20/(1+e^-20)); a 0.1 floor lifts the second to exactly 0.1.
    p = adapt(
        b,
        np.array([1.0, 0.0]),
        np.array([1, 0]),
        np.array([0.5, 0.5]),
        np.array([0.5, 0.5]),
        eligible=np.array([True, True]),
        min_prob=0.1,
    )
    assert p[1] == 0.1
    close(p, [0.9, 0.1])


@pytest.mark.parametrize("policy", ["exp_gradient", "exp3"])
def test_state_round_trip_continues_identically(policy):
    def run(p, windows):
        return [p.update(np.array(s), np.array(c), PRIOR, PRIOR).tolist() for s, c in windows]

    windows = [([2.0, 3.0, 1.0], [1, 2, 1]), ([3.0, 1.0, 0.0], [1, 1, 0]), ([1.0, 4.0, 2.0], [1, 2, 1])]
    a = make_policy(Adaptive(policy=policy, lr=0.7, smoothing=0.1), ["a", "b", "c"])
    b = make_policy(Adaptive(policy=policy, lr=0.7, smoothing=0.1), ["a", "b", "c"])
    run(a, windows[:1])
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert run(a, windows[1:]) == run(b, windows[1:])  # bit-identical after a JSON round trip
    assert a.state_dict() == b.state_dict()


def test_state_is_checked():
    eg = ExpGradient(2, lr=1.0, smoothing=0.0)
    with pytest.raises(StateError, match=r"^ExpGradient state: unknown key 'extra'"):
        eg.load_state_dict({"weights": None, "minimum": [None, None], "extra": 1})
    with pytest.raises(StateError, match=r"^ExpGradient state: 'minimum' must be a list of 2 numbers"):
        eg.load_state_dict({"weights": None, "minimum": [1.0]})
    with pytest.raises(StateError, match=r"^Exp3 state: missing key 'scores'"):
        Exp3(2, lr=1.0, smoothing=0.0).load_state_dict({})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"policy": "doremi"}, "Adaptive.policy: must be one of 'exp_gradient', 'exp3', got 'doremi'"),
        ({"lr": -1}, "Adaptive.lr: must be >= 0, got -1"),
        ({"update_every": 0}, "Adaptive.update_every: must be >= 1, got 0"),
        ({"smoothing": 1.5}, "Adaptive.smoothing: must be <= 1, got 1.5"),
        (
            {"policy": "exp3", "reference": {"a": 1.0}},
            "Adaptive.reference: only for policy 'exp_gradient' (got policy 'exp3')",
        ),
    ],
)
def test_adaptive_validation(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        Adaptive(**kwargs)


def test_reference_names_are_checked():
    with pytest.raises(ConfigError, match=r"^Adaptive.reference: unknown source 'x' \(sources: a, b\)$"):
        make_policy(Adaptive(reference={"x": 1.0}), ["a", "b"])


def test_config_form_round_trips_and_names_the_key_path():
    from mixer.config.schedule_config import parse_schedule, schedule_to_dict
    from mixer.mixing.schedule import Floored, Weights

    m = {"weights": {"a": 1, "b": 3}, "min_prob": 0.1, "adaptive": {"policy": "exp3", "lr": 0.5, "update_every": 10}}
    s = parse_schedule(m, ["a", "b"])
    assert s == Adaptive(Floored(Weights({"a": 1.0, "b": 3.0}), 0.1), policy="exp3", lr=0.5, update_every=10)
    assert s.min_prob == 0.1  # the floor applies to the adaptive shares too
    assert parse_schedule(schedule_to_dict(s), ["a", "b"]) == s
    for bad, message in [
        ({"lr": -1}, "schedule.adaptive.lr: must be >= 0, got -1"),
        ({"polcy": "exp3"}, "schedule.adaptive.polcy: unknown key; did you mean 'policy'?"),
        ({"reference": {"z": 1.0}}, "schedule.adaptive.reference: unknown source 'z' (sources: a, b)"),
        ({"update_every": 2.5}, "schedule.adaptive.update_every: must be an integer, got 2.5"),
    ]:
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            parse_schedule({"adaptive": bad}, ["a", "b"])
