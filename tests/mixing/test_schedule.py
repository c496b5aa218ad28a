"""Schedules: exact values (computed by hand in the comments) at boundaries and mid points, limits,
continuity of ramps, floors, hierarchical weights as in the omnilingual-asr mixture dataset
(fairseq2), and every validation error."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import mixer
from mixer.errors import ConfigError
from mixer.mixing.hierarchical import Hierarchical
from mixer.mixing.schedule import (
    Curriculum,
    Floored,
    Phase,
    Schedule,
    SourceInfo,
    Static,
    Temperature,
    Weights,
    apply_floor,
    check_schedule,
)

TIGHT = dict(rel=1e-12, abs=1e-15)


def info(sizes=(1.0, 1.0, 1.0), weights=None, names=None, groups=None) -> SourceInfo:
    n = len(sizes)
    return SourceInfo(
        names=tuple(names or "abcdefgh"[:n]),
        weights=np.asarray(weights if weights is not None else [1.0] * n, dtype=np.float64),
        sizes=np.asarray(sizes, dtype=np.float64),
        groups=tuple(groups or [None] * n),
    )


def close(p, expected, **tol):
    assert np.asarray(p).tolist() == pytest.approx(list(expected), **(tol or TIGHT))


# ----------------------------------------------------------------------------------- temperature

# sizes (1, 64): p ∝ size^(1/t) gives (1, 64^(1/t)): t=6 → (1, 2): (1/3, 2/3); t=3 → (1, 4): (.2, .8);
# t=2 → (1, 8): (1/9, 8/9); t=4 → (1, 2√2); t=1 → (1/65, 64/65).
I64 = info(sizes=(1, 64), weights=(0.5, 0.5))


def test_constant_temperature_on_sizes_is_nemo_formula():
    # Temperature(5.0) alone keeps the seam's behaviour: constant t on sizes, whatever the progress.
    t = Temperature(5.0)
    assert (t.start, t.end, t.shape, t.unit) == (5.0, None, "constant", None)
    sizes = info(sizes=(1, 32))  # 32^(1/5) = 2 → (1/3, 2/3)
    for step, tokens in [(0, 0.0), (10**9, 1e15)]:
        close(t.probs(sizes, step, tokens), [1 / 3, 2 / 3])
    close(Temperature(3.0).probs(I64, 0, 0), [0.2, 0.8])


def test_temperature_on_weights():
    # temperature on weights: p ∝ w^(1/t); weights (1, 4), t=2 → (1, 2)/3; sizes are not used.
    i = info(sizes=(100, 1), weights=(1, 4))
    close(Temperature(2.0, base="weights").probs(i, 0, 0), [1 / 3, 2 / 3])


def test_temperature_limits():
    i = info(sizes=(1, 3, 6))
    close(Temperature(1.0).probs(i, 0, 0), [0.1, 0.3, 0.6])  # t=1: proportional
    close(Temperature(1e12).probs(i, 0, 0), [1 / 3] * 3, rel=1e-9)  # t→∞: uniform
    close(Temperature(1e-3).probs(i, 0, 0), [0, 0, 1], abs=1e-12)  # t→0: the largest alone, no underflow
    # A zero stays zero at every temperature (t→∞ is uniform over the nonzero ones).
    close(Temperature(1e12).probs(info(sizes=(0, 2, 5)), 0, 0), [0, 0.5, 0.5], rel=1e-9)


@pytest.mark.parametrize(
    "progress,expected",
    [(0, 6.0), (25, 5.0), (50, 4.0), (75, 3.0), (100, 2.0), (250, 2.0), (-5, 6.0)],  # 6 + (2 - 6) * x
)
def test_linear_shape(progress, expected):
    assert Temperature(6.0, 2.0, "linear", steps=100).at(progress) == pytest.approx(expected, **TIGHT)


@pytest.mark.parametrize(
    "progress,expected",
    [
        (0, 6.0),
        (75, 2 + 2 * (1 + math.sqrt(0.5))),  # x=1/4: cos(pi/4) = √½
        (150, 4.0),  # x=1/2: cos = 0 → the midpoint
        (200, 3.0),  # x=2/3: cos = -1/2 → 2 + 4 * 1/4
        (300, 2.0),
        (10**6, 2.0),
    ],
)
def test_cosine_shape(progress, expected):
    assert Temperature(6.0, 2.0, "cosine", steps=300).at(progress) == pytest.approx(expected, **TIGHT)


def test_step_shape():
    t = Temperature(6.0, 2.0, "step", steps=100)
    assert [t.at(0), t.at(99), t.at(99.999), t.at(100), t.at(10**6)] == [6.0, 6.0, 6.0, 2.0, 2.0]
    close(t.probs(I64, 99, 0), [1 / 3, 2 / 3])
    close(t.probs(I64, 100, 0), [1 / 9, 8 / 9])


def test_shapes_give_exact_probabilities_over_steps():
    lin = Temperature(6.0, 2.0, "linear", steps=100)
    close(lin.probs(I64, 0, 1e12), [1 / 3, 2 / 3])  # tokens do not count for a steps schedule
    close(lin.probs(I64, 75, 0), [0.2, 0.8])
    close(lin.probs(I64, 100, 0), [1 / 9, 8 / 9])
    cos = Temperature(6.0, 2.0, "cosine", steps=300)
    close(cos.probs(I64, 0, 0), [1 / 3, 2 / 3])
    close(cos.probs(I64, 150, 0), [1 / (1 + 2 * math.sqrt(2)), 2 * math.sqrt(2) / (1 + 2 * math.sqrt(2))])
    close(cos.probs(I64, 200, 0), [0.2, 0.8])
    close(cos.probs(I64, 300, 0), [1 / 9, 8 / 9])


def test_temperature_over_tokens():
    t = Temperature(6.0, 2.0, "linear", tokens=1e9)
    assert t.unit == "tokens"
    close(t.probs(I64, 10**6, 0.0), [1 / 3, 2 / 3])  # steps do not count
    close(t.probs(I64, 0, 7.5e8), [0.2, 0.8])  # t = 3
    close(t.probs(I64, 0, 2e9), [1 / 9, 8 / 9])


def test_temperature_positional_and_keyword_forms():
    assert Temperature(6.0, 2.0, "cosine", steps=10) == Temperature(start=6.0, end=2.0, shape="cosine", steps=10)
    with pytest.raises(TypeError):
        Temperature(6.0, 2.0, "cosine", 10)  # type: ignore[misc]  # steps is keyword-only


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(start=0), "Temperature.start: must be > 0, got 0"),
        (dict(start=-1.0), "Temperature.start: must be > 0, got -1.0"),
        (dict(start=float("nan")), "Temperature.start: must be finite, got nan"),
        (dict(start=True), "Temperature.start: must be a number, got True"),
        (dict(start="5"), "Temperature.start: must be a number, got '5'"),
        (
            dict(start=5, shape="exp"),
            "Temperature.shape: must be one of 'constant', 'linear', 'cosine', 'step', got 'exp'",
        ),
        (dict(start=5, base="size"), "Temperature.base: must be 'sizes', 'weights' or None, got 'size'"),
        (dict(start=5, end=1), "Temperature.end: only used by a non-constant shape (shape='constant'), got 1"),
        (dict(start=5, steps=10), "Temperature.steps: only used by a non-constant shape (shape='constant'), got 10"),
        (
            dict(start=5, tokens=1e9),
            "Temperature.tokens: only used by a non-constant shape (shape='constant'), got 1000000000.0",
        ),
        (dict(start=5, shape="linear", steps=10), "Temperature.end: required by shape='linear'"),
        (dict(start=5, end=0, shape="linear", steps=10), "Temperature.end: must be > 0, got 0"),
        (
            dict(start=5, end=1, shape="cosine"),
            "Temperature: shape='cosine' needs exactly one of steps or tokens, got steps=None, tokens=None",
        ),
        (
            dict(start=5, end=1, shape="cosine", steps=10, tokens=1e9),
            "Temperature: shape='cosine' needs exactly one of steps or tokens, got steps=10, tokens=1000000000.0",
        ),
        (dict(start=5, end=1, shape="step", steps=0), "Temperature.steps: must be >= 1, got 0"),
        (dict(start=5, end=1, shape="step", steps=1.5), "Temperature.steps: must be an integer, got 1.5"),
        (dict(start=5, end=1, shape="step", tokens=-1), "Temperature.tokens: must be > 0, got -1"),
    ],
)
def test_temperature_validation(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        Temperature(**kwargs)


# ---------------------------------------------------------------------------------- static, weights


def test_static_and_weights():
    i = info(weights=(1, 3, 0))
    close(Static().probs(i, 5, 5.0), [0.25, 0.75, 0])
    close(Weights({"c": 3, "a": 1}).probs(i, 0, 0), [0.25, 0, 0.75])  # by name; b not named → 0
    with pytest.raises(ConfigError, match=r"^source weights: must have a positive finite sum \(got \[0.0, 0.0\]\)$"):
        Static().probs(info(sizes=(1, 1), weights=(0, 0)), 0, 0)
    with pytest.raises(ConfigError, match=r"^Weights.weights: unknown source 'z' \(sources: a, b, c\)$"):
        Weights({"z": 1}).probs(i, 0, 0)


@pytest.mark.parametrize(
    "weights,message",
    [
        ({}, "Weights.weights: must be a non-empty mapping of source name to weight, got {}"),
        ([1, 2], "Weights.weights: must be a non-empty mapping of source name to weight, got [1, 2]"),
        ({"a": -1}, "Weights.weights['a']: must be >= 0, got -1"),
        ({"a": float("inf")}, "Weights.weights['a']: must be finite, got inf"),
        ({"a": 0, "b": 0}, "Weights.weights: at least one weight must be > 0, got {'a': 0.0, 'b': 0.0}"),
        ({1: 1.0}, "Weights.weights: source names must be non-empty strings, got 1"),
    ],
)
def test_weights_validation(weights, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        Weights(weights)


def test_returned_vectors_are_fresh():
    # The core may scale a returned vector in place; cached vectors must not leak.
    i = info()
    p = Weights({"a": 1}).probs(i, 0, 0)
    p *= 0
    close(Weights({"a": 1}).probs(i, 0, 0), [1, 0, 0])
    c = Curriculum([Phase({"a": 1})])
    q = c.probs(i, 0, 0)
    q *= 0
    close(c.probs(i, 0, 0), [1, 0, 0])


# ------------------------------------------------------------------------------------- curriculum

ABC = info(sizes=(1, 1, 1), weights=(1, 1, 2))
STEPS = Curriculum(
    [
        Phase({"a": 1}, until=100),
        Phase({"b": 1}, until=300, ramp=100),
        Phase({"a": 1, "c": 1}, ramp=50),
    ],
    unit="steps",
)


@pytest.mark.parametrize(
    "x,expected",
    [
        (0, [1, 0, 0]),
        (99, [1, 0, 0]),
        (100, [1, 0, 0]),  # boundary: the ramp starts at the previous vector (a = 0)
        (150, [0.5, 0.5, 0]),  # a = 1/2
        (175, [0.25, 0.75, 0]),
        (200, [0, 1, 0]),  # ramp done
        (299, [0, 1, 0]),
        (300, [0, 1, 0]),
        (325, [0.25, 0.5, 0.25]),  # ½ (0, 1, 0) + ½ (½, 0, ½)
        (350, [0.5, 0, 0.5]),
        (10**9, [0.5, 0, 0.5]),
    ],
)
def test_curriculum_in_steps(x, expected):
    close(STEPS.probs(ABC, x, 1e18), expected)  # tokens do not count for a steps curriculum


def test_curriculum_in_tokens_and_phase_lookup():
    c = Curriculum([Phase({"a": 1}, until=2e11), Phase({"b": 1}, until=7e11, ramp=1e10), Phase(None)])
    assert c.unit == "tokens"
    assert [c.phase_at(x) for x in (0, 2e11 - 1, 2e11, 7e11 - 1, 7e11)] == [0, 0, 1, 1, 2]
    assert [c.start(k) for k in range(3)] == [0.0, 2e11, 7e11]
    close(c.probs(ABC, 10**9, 2.05e11), [0.5, 0.5, 0])
    close(c.probs(ABC, 0, 8e11), [0.25, 0.25, 0.5])  # weights=None: the sources' own weights (1, 1, 2)


def test_ramps_are_continuous_at_boundaries():
    c = Curriculum(
        [
            Phase({"a": 1, "b": 1}, until=1000.0),
            Phase({"b": 1}, until=3000.0, ramp=500.0, temperature=Temperature(2.0, 1.0, "linear", tokens=2000.0)),
            Phase({"c": 3, "a": 1}, ramp=1000.0),
        ]
    )
    eps = 1e-7
    for boundary, ramp in [(1000.0, 500.0), (3000.0, 1000.0)]:
        left, at, right = (c.probs(ABC, 0, x) for x in (boundary - eps, boundary, boundary + eps))
        assert np.abs(left - at).max() < 1e-9 and np.abs(right - at).max() < 1e-9
        end_left, end = c.probs(ABC, 0, boundary + ramp - eps), c.probs(ABC, 0, boundary + ramp)
        assert np.abs(end_left - end).max() < 1e-9
        # ...and the ramp actually moves (a constant schedule would pass the checks above).
        assert not np.allclose(at, end)


def test_no_ramp_is_a_jump():
    c = Curriculum([Phase({"a": 1}, until=10), Phase({"b": 1})], unit="steps")
    close(c.probs(ABC, 9, 0), [1, 0, 0])
    close(c.probs(ABC, 10, 0), [0, 1, 0])


def test_phase_temperature_counts_from_the_phase_start():
    # weights (1, 8) with t = 3 → (1, 2)/3; t = 2 → (1, 2√2); t = 1 → (1, 8)/9.
    c = Curriculum(
        [Phase({"a": 1}, until=100), Phase({"a": 1, "b": 8}, temperature=Temperature(3.0, 1.0, "linear", tokens=100))]
    )
    close(c.probs(ABC, 0, 100), [1 / 3, 2 / 3, 0])
    close(c.probs(ABC, 0, 150), [1 / (1 + 2 * math.sqrt(2)), 2 * math.sqrt(2) / (1 + 2 * math.sqrt(2)), 0])
    close(c.probs(ABC, 0, 200), [1 / 9, 8 / 9, 0])
    close(c.probs(ABC, 0, 10**6), [1 / 9, 8 / 9, 0])


def test_curriculum_temperature_is_global_and_applies_to_every_phase():
    # The form: phases in tokens, one temperature over global steps.
    c = Curriculum(
        [Phase({"a": 1, "b": 8}, until=1e9), Phase({"a": 1, "c": 64})],
        temperature=Temperature(3.0, 1.0, "linear", steps=100),
    )
    close(c.probs(ABC, 0, 0), [1 / 3, 2 / 3, 0])
    close(c.probs(ABC, 100, 0), [1 / 9, 8 / 9, 0])
    close(c.probs(ABC, 0, 2e9), [0.2, 0, 0.8])  # 64^(1/3) = 4
    close(c.probs(ABC, 10**6, 2e9), [1 / 65, 0, 64 / 65])


def test_phase_temperature_on_sizes_when_phase_has_no_weights():
    i = info(sizes=(1, 64, 0), weights=(1, 0, 1))
    c = Curriculum([Phase(None, until=10, temperature=Temperature(3.0, base="sizes")), Phase(None)], unit="steps")
    close(c.probs(i, 0, 0), [0.2, 0.8, 0])
    close(c.probs(i, 10, 0), [0.5, 0, 0.5])
    top = Curriculum([Phase(None)], temperature=Temperature(3.0, base="sizes"))
    close(top.probs(i, 0, 0), [0.2, 0.8, 0])


def test_curriculum_unknown_name_and_check_schedule():
    c = Curriculum([Phase({"a": 1}, until=10), Phase({"bookz": 1})], unit="steps")
    close(c.probs(ABC, 0, 0), [1, 0, 0])
    with pytest.raises(
        ConfigError, match=r"^Curriculum.phases\[1\].weights: unknown source 'bookz' \(sources: a, b, c\)$"
    ):
        c.probs(ABC, 10, 0)
    # check_schedule checks every phase up front (also through a floor), not only the first.
    close(check_schedule(Curriculum([Phase({"a": 1})]), ABC), [1, 0, 0])
    for s in (c, Floored(c, 0.1)):
        with pytest.raises(ConfigError, match=r"^Curriculum.phases\[1\].weights: unknown source 'bookz'"):
            check_schedule(s, ABC)
    bad_base = Curriculum([Phase({"a": 1}, until=10), Phase(None)], unit="steps")
    with pytest.raises(ConfigError, match=r"^source weights: must have a positive finite sum"):
        check_schedule(bad_base, info(weights=(0, 0, 0)))


def _phases(*phases):
    return list(phases)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Curriculum([]), "Curriculum.phases: must be a non-empty sequence of Phase, got []"),
        (lambda: Curriculum([Phase()], unit="samples"), "Curriculum.unit: must be 'tokens' or 'steps', got 'samples'"),
        (lambda: Curriculum([{"a": 1}]), "Curriculum.phases[0]: must be a Phase, got {'a': 1}"),
        (
            lambda: Curriculum([Phase(until=5)]),
            "Curriculum.phases[0].until: the last phase runs to the end of training; must be None, got 5",
        ),
        (
            lambda: Curriculum([Phase(), Phase()]),
            "Curriculum.phases[0].until: required (only the last phase has until=None)",
        ),
        (
            lambda: Curriculum([Phase(until=10), Phase(until=10), Phase()]),
            "Curriculum.phases[1].until: must be greater than the previous boundary 10, got 10",
        ),
        (
            lambda: Curriculum([Phase(until=10, ramp=1), Phase()]),
            "Curriculum.phases[0].ramp: the first phase has nothing to ramp from; must be 0, got 1",
        ),
        (
            lambda: Curriculum([Phase(until=10), Phase(until=15, ramp=6), Phase()]),
            "Curriculum.phases[1].ramp: longer than the phase (5 tokens), got 6",
        ),
        (
            lambda: Curriculum([Phase(until=10), Phase(temperature=Temperature(2, 1, "linear", steps=5))]),
            "Curriculum.phases[1].temperature: counts steps from the phase's start, but this curriculum counts "
            "tokens; give its length in tokens",
        ),
        (
            lambda: Curriculum([Phase({"a": 1})], temperature=Temperature(2, base="sizes")),
            "Curriculum.temperature.base: 'sizes' would ignore the weights of phases[0]; use 'weights' or None",
        ),
        (
            lambda: Curriculum([Phase()], temperature=2.0),
            "Curriculum.temperature: must be a Temperature or None, got 2.0",
        ),
        (
            lambda: Phase({"a": 1}, temperature=Temperature(2, base="sizes")),
            "Phase.temperature.base: 'sizes' would ignore this phase's weights; use 'weights' or None",
        ),
        (lambda: Phase(temperature=2.0), "Phase.temperature: must be a Temperature or None, got 2.0"),
        (lambda: Phase(until=0), "Phase.until: must be > 0, got 0"),
        (lambda: Phase(ramp=-1), "Phase.ramp: must be >= 0, got -1"),
        (lambda: Phase({"a": -0.5}), "Phase.weights['a']: must be >= 0, got -0.5"),
        (lambda: Phase({}), "Phase.weights: must be a non-empty mapping of source name to weight, got {}"),
        (lambda: Phase({"a": 0}), "Phase.weights: at least one weight must be > 0, got {'a': 0.0}"),
    ],
)
def test_curriculum_validation(make, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        make()


def test_ramp_may_fill_its_phase_exactly():
    c = Curriculum([Phase({"a": 1}, until=10), Phase({"b": 1}, until=20, ramp=10), Phase({"c": 1})], unit="steps")
    close(c.probs(ABC, 15, 0), [0.5, 0.5, 0])
    close(c.probs(ABC, 20, 0), [0, 0, 1])


# ----------------------------------------------------------------------------------- hierarchical

# A dataset summary in the omnilingual-asr format: (corpus, language, hours).
SUMMARY = [("librispeech", "eng", 960.5), ("commonvoice", "eng", 1500.2), ("commonvoice", "fra", 450.8)]
ASR = info(
    sizes=[h for _, _, h in SUMMARY], names=[f"{c}/{lang}" for c, lang, _ in SUMMARY], groups=[c for c, _, _ in SUMMARY]
)


@pytest.mark.parametrize(
    "beta_group,beta_source", [(0.5, 0.5), (0.0, 0.0), (1.0, 1.0), (0.3, 0.8), (1.0, 0.0), (0.0, 1.0)]
)
def test_hierarchical_matches_seed_002(beta_group, beta_source):
    # omnilingual-asr get_partition_weights_from_betas:
    #   corpus_weight = (corpus_hours / total_hours) ** beta_corpus, normalised over corpora
    #   lang_weight = (lang_hours_in_corpus / corpus_hours) ** beta_language, normalised within the corpus
    #   partition weight = corpus_weight * lang_weight
    total = sum(h for _, _, h in SUMMARY)
    corpora = sorted({c for c, _, _ in SUMMARY})
    corpus_hours = {c: sum(h for c2, _, h in SUMMARY if c2 == c) for c in corpora}
    cw = {c: (corpus_hours[c] / total) ** beta_group for c in corpora}
    cw = {c: v / sum(cw.values()) for c, v in cw.items()}
    lw = [(h / corpus_hours[c]) ** beta_source for c, _, h in SUMMARY]
    lsum = {c: sum(x for (c2, _, _), x in zip(SUMMARY, lw) if c2 == c) for c in corpora}
    expected = [cw[c] * x / lsum[c] for (c, _, _), x in zip(SUMMARY, lw)]
    close(Hierarchical(beta_group, beta_source).probs(ASR, 0, 0), expected)


def test_hierarchical_by_hand():
    # Group g = (1, 3), a source alone (group None) of 4; total 8. Betas ½: g gets √(4/8), the lone
    # source √(4/8): ½ each over groups. Within g √(1/4) = ½ and √(3/4) = √3/2, normalised
    # 1/(1+√3), √3/(1+√3); times ½.
    i = info(sizes=(1, 3, 4), groups=("g", "g", None))
    s3 = math.sqrt(3)
    close(Hierarchical(0.5, 0.5).probs(i, 0, 0), [1 / (2 * (1 + s3)), s3 / (2 * (1 + s3)), 1 / 2])
    close(Hierarchical(0.0, 0.0).probs(i, 0, 0), [1 / 4, 1 / 4, 1 / 2])  # beta 0: uniform over groups, then within
    close(Hierarchical(1.0, 1.0).probs(i, 0, 0), [1 / 8, 3 / 8, 4 / 8])  # beta 1: proportional
    close(Hierarchical(0.0, 1.0).probs(i, 0, 0), [1 / 8, 3 / 8, 1 / 2])  # groups equal, proportional inside
    close(Hierarchical(1.0, 0.0).probs(i, 0, 0), [1 / 4, 1 / 4, 1 / 2])
    # Groups of size 4 and 12 (of 16) at beta_group 1: ¼ and ¾; g's two sources share ¼ equally.
    close(Hierarchical(1.0, 0.0).probs(info(sizes=(1, 3, 12), groups=("g", "g", None)), 0, 0), [1 / 8, 1 / 8, 3 / 4])


def test_hierarchical_groups_of_one_and_three_sources():
    # a = (2) alone, b = (1, 2, 5); total 10, group sizes 2 and 8. The old once-over-all-sources
    # normalisation gave (¼, ¼, ¼, ¼) at beta 0.
    i = info(sizes=(2, 1, 2, 5), groups=("a", "b", "b", "b"))
    close(Hierarchical(0.0, 0.0).probs(i, 0, 0), [1 / 2, 1 / 6, 1 / 6, 1 / 6])
    close(Hierarchical(1.0, 1.0).probs(i, 0, 0), [0.2, 0.1, 0.2, 0.5])
    # Beta ½: groups √0.2 : √0.8 = 1 : 2 -> ⅓, ⅔; within b √(1/8) : √(2/8) : √(5/8) = 1 : √2 : √5.
    s = 1 + math.sqrt(2) + math.sqrt(5)
    close(
        Hierarchical(0.5, 0.5).probs(i, 0, 0),
        [1 / 3, 2 / (3 * s), 2 * math.sqrt(2) / (3 * s), 2 * math.sqrt(5) / (3 * s)],
    )


def test_hierarchical_none_groups_are_separate_and_empty_sources_get_nothing():
    i = info(sizes=(1, 3, 0), groups=(None, None, "g"))
    close(Hierarchical(0.0, 0.0).probs(i, 0, 0), [0.5, 0.5, 0])  # 0^0 would be 1: not for an empty source
    i = info(sizes=(1, 3, 0, 4), groups=(None, None, "g", "g"))
    close(Hierarchical(0.0, 0.0).probs(i, 0, 0), [1 / 3, 1 / 3, 0, 1 / 3])


@pytest.mark.parametrize(
    "args,message",
    [
        ((-0.1, 0.5), "Hierarchical.beta_group: must be >= 0, got -0.1"),
        ((0.5, float("nan")), "Hierarchical.beta_source: must be finite, got nan"),
        ((0.5, None), "Hierarchical.beta_source: must be a number, got None (NoneType)"),
    ],
)
def test_hierarchical_validation(args, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        Hierarchical(*args)


def test_hierarchical_needs_sizes():
    with pytest.raises(ConfigError, match=r"^source sizes: must have a positive finite sum"):
        Hierarchical(1, 1).probs(info(sizes=(0, 0)), 0, 0)


# ------------------------------------------------------------------------------------------ floors


def test_floor_one_round():
    # c is raised to 0.05; a and b share 0.95 in their ratio 0.9 : 0.08.
    i = info()
    p = Floored(Weights({"a": 0.9, "b": 0.08, "c": 0.02}), 0.05).probs(i, 0, 0)
    assert p[2] == 0.05
    close(p, [0.9 * 0.95 / 0.98, 0.08 * 0.95 / 0.98, 0.05])


def test_floor_iterates_until_stable():
    # Round 1: c (0.04) and d (0) go to 0.1; a, b share 0.8: b = 0.11 · 0.8 / 0.96 = 0.0917 < 0.1.
    # Round 2: b goes to 0.1 as well; a alone gets 0.7.
    p = apply_floor(np.array([0.85, 0.11, 0.04, 0.0]), np.ones(4, bool), 0.1)
    assert p[1:].tolist() == [0.1, 0.1, 0.1]
    close(p, [0.7, 0.1, 0.1, 0.1])


def test_floor_saturated_and_ineligible():
    close(apply_floor(np.array([1.0, 0, 0, 0]), np.ones(4, bool), 0.25), [0.25] * 4)
    # A source of size 0 is not floored (it could never deliver).
    i = info(sizes=(1, 1, 0))
    close(Floored(Weights({"a": 1}), 0.2).probs(i, 0, 0), [0.8, 0.2, 0])
    close(Floored(Static(), 0.0).probs(info(weights=(1, 0, 3)), 0, 0), [0.25, 0, 0.75])


def test_floor_lifts_a_source_a_phase_leaves_out():
    # The floor: no starvation, even where a phase gives a source nothing.
    c = Floored(Curriculum([Phase({"a": 1}, until=10), Phase({"a": 1, "b": 1})], unit="steps"), 0.1)
    close(c.probs(ABC, 0, 0), [0.8, 0.1, 0.1])
    close(c.probs(ABC, 10, 0), [0.45, 0.45, 0.1])


def test_floor_invariants_on_random_vectors():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 9))
        p = rng.dirichlet(np.full(n, 0.3))
        eligible = rng.random(n) < 0.8
        k = max(int(eligible.sum()), 1)
        f = float(rng.uniform(0, 1 / k))
        q = apply_floor(p, eligible, f)
        assert abs(q.sum() - 1) < 1e-12
        assert np.all(q[eligible] >= f)
        untouched = q != f
        # Entries left above the floor keep their ratios (scaled by one common factor).
        if untouched.sum() >= 2 and p[untouched].min() > 0:
            ratios = q[untouched] / p[untouched]
            assert ratios.max() - ratios.min() < 1e-9 * ratios.max()


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Floored(Static(), -0.1), "Floored.min_prob: must be >= 0, got -0.1"),
        (lambda: Floored(Static(), 1.5), "Floored.min_prob: must be <= 1, got 1.5"),
        (lambda: Floored(Static(), float("nan")), "Floored.min_prob: must be finite, got nan"),
        (lambda: Floored({"a": 1}, 0.1), "Floored.schedule: must be a schedule (with probs()), got {'a': 1}"),
        (lambda: Floored(Static(), 0.4).probs(info(), 0, 0), "Floored.min_prob: 0.4 * 3 sources = 1.2 exceeds 1"),
    ],
)
def test_floor_validation(make, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        make()


# --------------------------------------------------------------------------------------- protocol


def test_every_schedule_is_a_frozen_schedule_and_pure():
    schedules = [
        Static(),
        Weights({"a": 1}),
        Temperature(2.0, 1.0, "cosine", steps=10),
        STEPS,
        Hierarchical(0.5, 0.5),
        Floored(Temperature(2.0), 0.1),
    ]
    i = info(sizes=(1, 2, 3), weights=(3, 2, 1))
    before = (i.sizes.copy(), i.weights.copy())
    for s in schedules:
        assert isinstance(s, Schedule)
        with pytest.raises(AttributeError):
            s.anything = 1  # type: ignore[attr-defined]  # frozen
        a, b = s.probs(i, 7, 123.0), s.probs(i, 7, 123.0)
        assert a.tolist() == b.tolist() and abs(a.sum() - 1) < 1e-12 and np.all(a >= 0)
    assert i.sizes.tolist() == before[0].tolist() and i.weights.tolist() == before[1].tolist()


def test_check_schedule_rejects_bad_vectors():
    class Bad:
        def probs(self, info, step, tokens):
            return np.array([0.5, 0.6])

    with pytest.raises(ConfigError, match=r"probs must be 3 finite shares >= 0 summing to 1, got \[0.5, 0.6\]"):
        check_schedule(Bad(), info())
    with pytest.raises(ConfigError, match=r"^schedule: must have probs\(info, step, tokens\), got 3$"):
        check_schedule(3, info())  # type: ignore[arg-type]


class _AddressRepr:
    """A user schedule without a repr of its own: ``object.__repr__`` holds its address."""

    def probs(self, info, step, tokens):
        return np.full(len(info.names), 1.0 / len(info.names))


class _Described(_AddressRepr):
    def describe(self):
        return "uniform"


def test_a_schedule_whose_description_holds_an_address_is_refused_when_the_mixture_is_built(three_sources):
    from mixer.mixing.schedule import describe_schedule

    with pytest.raises(
        mixer.ConfigError, match=r"schedule _AddressRepr: its description .* holds an object address.*describe\(\)"
    ):
        describe_schedule(_AddressRepr())
    with pytest.raises(mixer.ConfigError, match=r"schedule Floored: its description .* holds an object address"):
        describe_schedule(mixer.Floored(_AddressRepr(), 0.01))
    sources = [mixer.Source(name, three_sources[name][0]) for name in three_sources]
    with pytest.raises(mixer.ConfigError, match="holds an object address"):
        mixer.Mixture(sources, batching=mixer.TokenBudget(max_tokens=65536), schedule=_AddressRepr())
    # with describe(): the same fingerprint in every process, whatever the object's address
    a = mixer.Mixture(sources, batching=mixer.TokenBudget(max_tokens=65536), schedule=_Described())
    b = mixer.Mixture(sources, batching=mixer.TokenBudget(max_tokens=65536), schedule=_Described())
    assert a.fingerprint == b.fingerprint
    assert describe_schedule(mixer.Temperature(2.0)) == repr(mixer.Temperature(2.0))
