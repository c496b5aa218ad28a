"""Config files: the issue's YAML, round trips, every validation error with its key path, NeMo's keys,
the examples, and building a real mixture from a config."""

from __future__ import annotations

import copy
import glob
import os
import re
import textwrap
import warnings
from typing import Any

import numpy as np
import pytest
import yaml

from mixer import Field, Packed, Source, TokenBudget
from mixer.config.mixture_config import (
    NEMO_KEYS,
    ImportPath,
    MixtureConfig,
    build_mixture,
    load_config,
    parse_config,
    resolve_import,
)
from mixer.errors import ConfigError, MixerError
from mixer.mixing.hierarchical import Hierarchical
from mixer.mixing.schedule import Curriculum, Floored, Phase, SourceInfo, Static, Temperature, Weights

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")

ISSUE_YAML = """\
seed: 0
batching: {max_tokens: 65536, multiple_of: 8}
sources:
  - {name: web,   urls: "s3://corpus/web/{000000..004095}.tar",  weight: 0.6, size: 1.2e12, group: en}
  - {name: code,  urls: "https://host/code/{0000..0511}.tar",    weight: 0.3, size: 2.0e11, group: code}
  - {name: books, urls: "/data/books/{00..63}.tar",              weight: 0.1, size: 5.0e10, group: en}
schedule:
  temperature: {start: 5.0, end: 1.0, shape: cosine, steps: 100000}
  phases:
    - {until_tokens: 2.0e11, weights: {books: 0.6, web: 0.3, code: 0.1}}
    - {until_tokens: 7.0e11, weights: {books: 0.3, code: 0.3, web: 0.4}, ramp_tokens: 1.0e10}
    - {weights: {web: 0.5, code: 0.2, books: 0.3}, ramp_tokens: 1.0e10}
  min_prob: 0.01
"""

ISSUE_SPEC = MixtureConfig(
    sources=(
        Source(name="web", urls=("s3://corpus/web/{000000..004095}.tar",), weight=0.6, size=1.2e12, group="en"),
        Source(name="code", urls=("https://host/code/{0000..0511}.tar",), weight=0.3, size=2.0e11, group="code"),
        Source(name="books", urls=("/data/books/{00..63}.tar",), weight=0.1, size=5.0e10, group="en"),
    ),
    batching=TokenBudget(max_tokens=65536, multiple_of=8),
    schedule=Floored(
        Curriculum(
            [
                Phase({"books": 0.6, "web": 0.3, "code": 0.1}, until=2.0e11),
                Phase({"books": 0.3, "code": 0.3, "web": 0.4}, until=7.0e11, ramp=1.0e10),
                Phase({"web": 0.5, "code": 0.2, "books": 0.3}, ramp=1.0e10),
            ],
            "tokens",
            temperature=Temperature(5.0, 1.0, "cosine", steps=100000),
        ),
        0.01,
    ),
    seed=0,
)


def base() -> dict[str, Any]:
    """The issue's config as a fresh dict."""
    return yaml.safe_load(ISSUE_YAML.replace("e12", "e+12").replace("e11", "e+11").replace("e10", "e+10"))


def small(**extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "batching": {"max_tokens": 4096},
        "sources": [
            {"name": "a", "urls": "/d/a-{0..3}.tar"},
            {"name": "b", "urls": ["/d/b-0.tar", "/d/b-1.tar"]},
            {"name": "c", "urls": "/d/c.tar"},
        ],
    }
    cfg.update(extra)
    return cfg


def write(tmp_path, text: str, name: str = "mix.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# ------------------------------------------------------------------------------------ issue's form


def test_issue_yaml_parses_into_the_expected_spec(tmp_path):
    spec = parse_config(write(tmp_path, ISSUE_YAML))
    assert spec == ISSUE_SPEC
    # PyYAML alone reads 1.2e12 as a string (YAML 1.1 wants 1.2e+12); the loader reads a float.
    assert isinstance(spec.sources[0].size, float) and spec.sources[0].size == 1.2e12
    assert parse_config(base()) == ISSUE_SPEC  # the same as a dict


def test_issue_schedule_values():
    spec = parse_config(base())
    info = SourceInfo(
        names=("web", "code", "books"),
        weights=np.array([0.6, 0.3, 0.1]),
        sizes=np.array([1.2e12, 2e11, 5e10]),
        groups=("en", "code", "en"),
    )
    p = spec.schedule.probs(info, 100000, 2.0e11)  # t = 1 by now; boundary: still phase 1's vector
    assert p.tolist() == pytest.approx([0.3, 0.1, 0.6], rel=1e-12)
    p = spec.schedule.probs(info, 100000, 2.05e11)  # halfway up the ramp to phase 2
    assert p.tolist() == pytest.approx([0.35, 0.2, 0.45], rel=1e-12)
    p = spec.schedule.probs(info, 10**6, 1e12)
    assert p.tolist() == pytest.approx([0.5, 0.2, 0.3], rel=1e-12)


# ------------------------------------------------------------------------------------- round trip

ROUND_TRIP = {
    "issue": base(),
    "small": small(),
    "everything": small(
        seed=3,
        selector="random",
        unit="samples",
        mix="sample",
        stop="all_exhausted",
        shuffle_buffer=64,
        pad_id=-1,
        dtype="int64",
        batching={
            "max_tokens": 8192,
            "buckets": [64, 256, 1024],
            "max_batch_size": 128,
            "multiple_of": 8,
            "max_length": 2048,
            "overlong": "drop",
            "num_buckets": 8,
            "max_bucket_ratio": 1.2,
            "max_wait": 5,
        },
        state_every=16,
        buffer_budget="2M tokens",
        sources=[
            {
                "name": "a",
                "urls": ["s3://b/a-{0..3}.tar", "s3://b/x/"],
                "weight": 2,
                "size": 1e9,
                "decode": "json:loads",
                "length": "pkg.mod:obj.length",
                "on_error": "skip",
                "storage_options": {"anon": True},
                "group": "g",
                "io_options": {"timeout": 30, "retries": 3, "read_ahead": 0},
            },
            {"name": "b", "urls": "/d/b.tar", "weight": 0},
        ],
        schedule={
            "temperature": {"start": 3, "end": 1, "shape": "step", "tokens": 1e9, "base": "weights"},
            "min_prob": 0.1,
        },
    ),
    "hierarchical": small(schedule={"hierarchical": {"beta_group": 0.5, "beta_source": 0.3}}),
    "weights": small(schedule={"weights": {"c": 3, "a": 1}, "min_prob": 0.1}),
    "temperature": small(schedule={"temperature": 2.5}),
    "floor_only": small(schedule={"min_prob": 0.2}),
    "steps": small(
        schedule={
            "phases": [
                {
                    "until_steps": 100,
                    "weights": {"a": 1},
                    "temperature": {"start": 2, "end": 1, "shape": "linear", "steps": 50},
                },
                {"until_steps": 300, "ramp_steps": 20},
                {"weights": {"b": 1, "c": 2}, "ramp_steps": 5, "temperature": {"start": 2, "base": "weights"}},
            ]
        }
    ),
    "nemo": small(concat_sampling_technique="random", concat_sampling_probabilities=[0.5, 0.25, 0.25], shuffle=False),
    "packed": small(
        batching={
            "packed": True,
            "max_tokens": 8192,
            "seq_len": 2048,
            "split_documents": True,
            "max_length": 100000,
            "overlong": "drop",
            "open_batches": 2,
        },
    ),
    "packed_flat": small(batching={"packed": True, "max_tokens": 4096}),
    "packed_false": small(batching={"packed": False, "max_tokens": 4096, "max_wait": 3}),
    "fields": small(
        fields={"audio": {"dtype": "float32", "pad": -2.5}, "text": {"dtype": "int64", "pad": -1}, "speaker": {}},
        sources=[
            {"name": "a", "urls": "/d/a.tar", "decode": "pkg.speech:decode", "length": "audio"},
            {"name": "b", "urls": "/d/b.tar", "decode": "pkg.speech:decode", "length": "pkg.speech:frames"},
            {"name": "c", "urls": "/d/c.tar", "decode": "pkg.speech:decode"},
        ],
        state_every=1,
    ),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_round_trip(name, tmp_path):
    spec = parse_config(ROUND_TRIP[name])
    data = spec.to_dict()
    assert parse_config(data) == spec
    assert parse_config(data).to_dict() == data
    # ... and through a YAML file.
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert parse_config(str(path)) == spec


def test_to_dict_is_canonical():
    data = parse_config(small(concat_sampling_technique="round-robin", concat_shuffle=False)).to_dict()
    assert data == {
        "seed": 0,
        "sources": [
            {"name": "a", "urls": "/d/a-{0..3}.tar", "weight": 1.0},
            {"name": "b", "urls": ["/d/b-0.tar", "/d/b-1.tar"], "weight": 1.0},
            {"name": "c", "urls": "/d/c.tar", "weight": 1.0},
        ],
        # Every TokenBudget field that is not None (the defaults are the class's own now).
        "batching": {
            "max_tokens": 4096,
            "multiple_of": 1,
            "overlong": "truncate",
            "num_buckets": 16,
            "max_bucket_ratio": 1.05,
        },
        "selector": "round_robin",
        "unit": "tokens",
        "mix": "batch",
        "stop": "never",
        "shuffle_buffer": 0,
        "pad_id": 0,
        "dtype": "int32",
        "state_every": 64,
        "buffer_budget": "8000000 tokens",
    }


class Custom:
    """A schedule of the user's own (the Schedule protocol): code only, no config form."""

    def probs(self, info, step, tokens):
        return np.ones(len(info.names)) / len(info.names)

    def __repr__(self):
        return "Custom()"


def test_to_dict_rejects_schedules_without_config_form():
    spec = parse_config(small())
    odd = MixtureConfig(sources=spec.sources, batching=spec.batching, schedule=Custom())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^schedule: Custom\(\) has no config form"):
        odd.to_dict()


def test_defaults():
    spec = parse_config(small())
    assert (
        spec.schedule,
        spec.selector,
        spec.unit,
        spec.mix,
        spec.stop,
        spec.seed,
        spec.shuffle_buffer,
        spec.pad_id,
        spec.dtype,
    ) == (
        None,
        "deficit",
        "tokens",
        "batch",
        "never",
        0,
        1000,
        0,
        "int32",
    )
    assert spec.sources[1] == Source(name="b", urls=("/d/b-0.tar", "/d/b-1.tar"))
    assert spec.batching == TokenBudget(max_tokens=4096)
    assert (spec.state_every, spec.fields, spec.batching.max_wait) == (64, None, None)


def test_a_buffer_budget_carries_its_unit():
    """Tokens by default; ``k``/``M``/``G`` suffixes; the canonical form writes the integer."""
    assert parse_config(small()).buffer_budget == "8000000 tokens"
    for given, canonical in [
        ("8M tokens", "8000000 tokens"),
        ("64k tokens", "64000 tokens"),
        ("1G tokens", "1000000000 tokens"),
        ("16_000_000 tokens", "16000000 tokens"),
        ("65536 samples", "65536 samples"),
        (None, None),
    ]:
        spec = parse_config(small(buffer_budget=given))
        assert spec.buffer_budget == canonical
        assert spec.to_dict()["buffer_budget"] == canonical and parse_config(spec.to_dict()) == spec


def test_a_bare_integer_budget_still_counts_samples_and_says_so():
    """An integer is what a budget was before it had a unit (samples): it keeps that meaning, and
    warns once, where it is given, how to say it from now on."""
    with pytest.warns(FutureWarning, match=r"buffer_budget=4096: a bare integer counts samples.*'4096 samples'"):
        spec = parse_config(small(buffer_budget=4096))
    assert spec.buffer_budget == "4096 samples"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_config(spec.to_dict()) == spec  # the canonical form does not warn again


def test_integral_floats_are_integers():
    spec = parse_config(small(batching={"max_tokens": 6.5e4}, schedule={"phases": [{"until_steps": 1e5}, {}]}))
    assert spec.batching.max_tokens == 65000 and isinstance(spec.batching.max_tokens, int)
    assert spec.schedule.unit == "steps" and spec.schedule.phases[0].until == 100000
    assert isinstance(spec.schedule.phases[0].until, int)


def test_packed_fields_and_state_every_specs():
    spec = parse_config(small(batching={"packed": True, "max_tokens": 8192, "seq_len": 1024}, state_every=8))
    assert spec.batching == Packed(max_tokens=8192, seq_len=1024) and spec.state_every == 8
    assert spec.to_dict()["batching"] == {
        "packed": True,
        "max_tokens": 8192,
        "seq_len": 1024,
        "split_documents": False,
        "overlong": "truncate",
        "open_batches": 4,
    }
    assert spec.to_dict()["state_every"] == 8
    # packed: false is the token budget, as if absent (and to_dict leaves it out).
    plain = parse_config(small(batching={"packed": False, "max_tokens": 64, "max_wait": 2}))
    assert plain.batching == TokenBudget(max_tokens=64, max_wait=2) and "packed" not in plain.to_dict()["batching"]
    # A split document may be longer than a row, so max_length is then bounded by nothing but >= 1.
    assert (
        parse_config(
            small(batching={"packed": True, "max_tokens": 64, "split_documents": True, "max_length": 10**6})
        ).batching.max_length
        == 10**6
    )
    spec = parse_config(
        small(
            fields={
                "audio": {"dtype": "float32", "pad": -2.0},
                "text": {},
                "mel": {"dtype": "bfloat16", "feature_shape": [80]},
            },
            sources=[
                {"name": "a", "urls": "/a.tar", "length": "audio"},
                {"name": "b", "urls": "/b.tar", "length": "m.n:f"},
            ],
        )
    )
    assert spec.fields == {
        "audio": Field(dtype="float32", pad=-2.0),
        "text": Field(),
        "mel": Field("bfloat16", feature_shape=(80,)),
    }
    assert list(spec.fields) == ["audio", "text", "mel"]  # in order: the first field counts when length is not given
    assert [s.length for s in spec.sources] == ["audio", ImportPath("m.n:f")]  # a field name, an import path
    assert spec.to_dict()["fields"] == {
        "audio": {"dtype": "float32", "pad": -2.0},
        "text": {"dtype": "int32", "pad": 0},
        "mel": {"dtype": "bfloat16", "pad": 0, "feature_shape": [80]},
    }
    assert parse_config(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec  # YAML round trip
    assert parse_config(small(fields=None)).fields is None


def test_every_keyword_is_a_config_key():
    """Rule 5: each keyword of the configured classes has a key of its name; deployment (rank,
    world_size, dp_group) and allow_pipe (code only) are the deliberate exceptions."""
    import inspect

    import mixer
    from mixer.config.mixture_config import BATCHING_KEYS, FIELD_KEYS, NATIVE_KEYS, PACKED_KEYS, SOURCE_KEYS

    def keywords(cls: Any) -> set[str]:
        return set(inspect.signature(cls).parameters)

    assert keywords(mixer.Mixture) - {"rank", "world_size", "dp_group"} == set(NATIVE_KEYS)
    assert keywords(mixer.Source) - {"allow_pipe"} == set(SOURCE_KEYS)
    assert keywords(mixer.TokenBudget) == set(BATCHING_KEYS) - {"packed"}
    assert keywords(mixer.Packed) == set(PACKED_KEYS) - {"packed"}
    assert keywords(mixer.Field) == set(FIELD_KEYS)


def test_config_defaults_and_choices_match_the_library():
    # The config builds the library's own classes (no mirror to drift); what is left to agree is
    # the options' dataclass with Mixture's signature.
    import dataclasses
    import inspect

    import mixer

    params = inspect.signature(mixer.Mixture).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(MixtureConfig) if f.default is not dataclasses.MISSING}
    assert defaults == {name: params[name].default for name in defaults}
    spec = parse_config(small())
    assert (spec.batching, spec.sources[0]) == (mixer.TokenBudget(4096), mixer.Source("a", "/d/a-{0..3}.tar"))


# ------------------------------------------------------------------------------------- validation


def _set(path: str, value: Any):
    """A mutation of `small()` setting a dotted path (list indices as [i]); `value=DELETE` removes it."""

    def mutate(cfg: dict[str, Any]) -> None:
        parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]
        node: Any = cfg
        for part in parts[:-1]:
            if isinstance(node, dict) and part not in node:
                node[part] = {}
            node = node[part]
        if value is DELETE:
            del node[parts[-1]]
        else:
            node[parts[-1]] = value

    return mutate


DELETE = object()
PHASES = {
    "phases": [
        {"until_tokens": 100, "weights": {"a": 1}},
        {"until_tokens": 200, "ramp_tokens": 50},
        {"weights": {"b": 1}},
    ]
}

ERRORS = [
    # root
    (_set("sourcs", []), "sourcs: unknown key; did you mean 'sources'?"),
    (
        _set("zzz", 1),
        "zzz: unknown key (expected one of: sources, batching, schedule, selector, unit, mix, stop, seed, "
        "shuffle_buffer, pad_id, dtype, state_every, buffer_budget, fields, profile_cache, profile_share, "
        "sampling_technique, sampling_temperature, sampling_probabilities, sampling_scale, shuffle, "
        "concat_sampling_technique, concat_sampling_temperature, concat_sampling_probabilities, "
        "concat_sampling_scale, concat_shuffle, concat_sampling_seed)",
    ),
    (_set("sources", DELETE), "sources: required"),
    (_set("batching", DELETE), "batching: required"),
    (
        _set("selector", "round-robin"),
        "selector: must be one of 'deficit', 'random', 'round_robin', got 'round-robin'; did you mean 'round_robin'?",
    ),
    (_set("selector", None), "selector: must be one of 'deficit', 'random', 'round_robin', got None (NoneType)"),
    (_set("unit", "token"), "unit: must be one of 'tokens', 'samples', got 'token'; did you mean 'tokens'?"),
    (_set("mix", "batches"), "mix: must be one of 'batch', 'sample', got 'batches'; did you mean 'batch'?"),
    (_set("stop", "first"), "stop: must be one of 'never', 'first_exhausted', 'all_exhausted', got 'first'"),
    (_set("seed", -1), "seed: must be >= 0, got -1"),
    (_set("seed", 1.5), "seed: must be an integer, got 1.5"),
    (_set("seed", "0"), "seed: must be an integer, got '0'"),
    (_set("shuffle_buffer", -5), "shuffle_buffer: must be >= 0, got -5"),
    (_set("buffer_budget", 0), "buffer_budget: must be >= 1, got 0"),
    (_set("buffer_budget", 2.5), "buffer_budget: must be an integer, got 2.5"),
    (_set("buffer_budget", "0 tokens"), "buffer_budget: must be >= 1, got 0"),
    (
        _set("buffer_budget", "64MiB"),
        "buffer_budget: must be a number of tokens or samples such as '8M tokens' or '65536 samples' "
        "(units: tokens, samples; suffixes k, M, G), got '64MiB'",
    ),
    (
        _set("buffer_budget", "8M bytes"),
        "buffer_budget: must be a number of tokens or samples such as '8M tokens' or '65536 samples' "
        "(units: tokens, samples; suffixes k, M, G), got '8M bytes'",
    ),
    (_set("pad_id", True), "pad_id: must be an integer, got True"),
    (_set("dtype", "float32"), "dtype: must be one of 'int32', 'int64', got 'float32'"),
    (_set("state_every", 0), "state_every: must be >= 1, got 0"),
    (_set("state_every", 2.5), "state_every: must be an integer, got 2.5"),
    (_set("state_every", None), "state_every: must be an integer, got None (NoneType)"),
    # sources
    (_set("sources", []), "sources: must be a non-empty list of sources, got [] (list)"),
    (_set("sources", {"a": 1}), "sources: must be a non-empty list of sources, got {'a': 1} (dict)"),
    (_set("sources[2]", "c"), "sources[2]: must be a mapping, got 'c'"),
    (_set("sources[2].weight", -1), "sources[2].weight: must be >= 0, got -1"),
    (_set("sources[2].weight", "lots"), "sources[2].weight: must be a number, got 'lots'"),
    (_set("sources[2].weight", float("inf")), "sources[2].weight: must be finite, got inf"),
    (_set("sources[1].wieght", 1), "sources[1].wieght: unknown key; did you mean 'weight'?"),
    (_set("sources[1].name", DELETE), "sources[1].name: required"),
    (_set("sources[1].urls", DELETE), "sources[1].urls: required"),
    (_set("sources[1].name", ""), "sources[1].name: must be a non-empty string, got ''"),
    (_set("sources[2].name", "a"), "sources[2].name: duplicate of sources[0].name, got 'a'"),
    (_set("sources[0].urls", []), "sources[0].urls: must be a pattern or a non-empty list of patterns, got [] (list)"),
    (_set("sources[1].urls[1]", 3), "sources[1].urls[1]: must be a non-empty string, got 3"),
    (_set("sources[0].size", 0), "sources[0].size: must be > 0, got 0"),
    (
        _set("sources[0].decode", "mypkg.decode"),
        "sources[0].decode: must be an import path 'package.module:function', got 'mypkg.decode'",
    ),
    (
        _set("sources[0].length", 5),
        "sources[0].length: must be an import path 'package.module:function' or the name of a field, got 5",
    ),
    (
        _set("sources[0].length", "pkg.mod"),
        "sources[0].length: must be an import path 'package.module:function' or the name of a field, got 'pkg.mod'",
    ),
    (
        _set("sources[0].length", "audio"),
        "sources[0].length: 'audio' names a field, but there is no 'fields' key; add fields, or give an import path "
        "'package.module:function'",
    ),
    (
        lambda c: c.update(fields={"audio": {}, "text": {}}) or c["sources"][0].update(length="audoi"),
        "sources[0].length: names no field of 'fields', got 'audoi'; did you mean 'audio'?",
    ),
    (
        lambda c: c.update(fields={"audio": {}, "text": {}}) or c["sources"][2].update(length="x"),
        "sources[2].length: names no field of 'fields', got 'x' (fields: audio, text)",
    ),
    (_set("sources[0].io_options", "fast"), "sources[0].io_options: must be a mapping, got 'fast'"),
    (_set("sources[0].on_error", "ignore"), "sources[0].on_error: must be one of 'raise', 'skip', got 'ignore'"),
    (_set("sources[0].storage_options", "anon"), "sources[0].storage_options: must be a mapping, got 'anon'"),
    (_set("sources[0].group", 3), "sources[0].group: must be a non-empty string, got 3"),
    (
        _set("sources[0].allow_pipe", True),
        "sources[0].allow_pipe: not a config key: 'pipe:' URLs run shell commands, so only code can allow them "
        "(build_mixture(spec, allow_pipe=True) or load_config(path, allow_pipe=True)), never a config file alone",
    ),
    (
        _set("sources[0].io_options", {"timout": 1}),
        "sources[0].io_options: unknown key 'timout'; did you mean 'timeout'?",
    ),
    (_set("sources[0].io_options", {"retries": -1}), "sources[0].io_options.retries: must be >= 0, got -1"),
    (lambda c: [s.update(weight=0) for s in c["sources"]], "sources: every weight is 0; at least one must be > 0"),
    # batching
    (_set("batching", 4096), "batching: must be a mapping, got 4096"),
    (_set("batching.max_token", 5), "batching.max_token: unknown key; did you mean 'max_tokens'?"),
    (_set("batching.max_tokens", DELETE), "batching.max_tokens: required"),
    (_set("batching.max_tokens", 0), "batching.max_tokens: must be >= 1, got 0"),
    (_set("batching.max_tokens", "4k"), "batching.max_tokens: must be an integer, got '4k'"),
    (_set("batching.max_length", 5000), "batching.max_length: must be <= 4096, got 5000"),
    (_set("batching.multiple_of", 0), "batching.multiple_of: must be >= 1, got 0"),
    (_set("batching.max_batch_size", 2.5), "batching.max_batch_size: must be an integer, got 2.5"),
    (_set("batching.overlong", "cut"), "batching.overlong: must be one of 'truncate', 'drop', got 'cut'"),
    (_set("batching.buckets", []), "batching.buckets: must be a non-empty list of increasing lengths, got [] (list)"),
    (_set("batching.buckets", [64, 64]), "batching.buckets[1]: must be greater than batching.buckets[0] (64), got 64"),
    (_set("batching.buckets", [64, 8192]), "batching.buckets[1]: must be <= max_tokens (4096), got 8192"),
    (
        lambda c: c["batching"].update(max_length=100, buckets=[50, 200]),
        "batching.buckets[1]: must be <= max_length (100), got 200",
    ),
    (_set("batching.num_buckets", 0), "batching.num_buckets: must be >= 1, got 0"),
    (_set("batching.max_bucket_ratio", 1), "batching.max_bucket_ratio: must be > 1, got 1"),
    (_set("batching.max_wait", 0), "batching.max_wait: must be >= 1, got 0"),
    (_set("batching.max_wait", 1.5), "batching.max_wait: must be an integer, got 1.5"),
    # batching: packed
    (_set("batching.packed", "yes"), "batching.packed: must be true or false, got 'yes'"),
    (_set("batching.packed", None), "batching.packed: must be true or false, got None (NoneType)"),
    (_set("batching.seq_len", 512), "batching.seq_len: a Packed option; set batching.packed: true to pack documents"),
    (
        _set("batching.open_batches", 2),
        "batching.open_batches: a Packed option; set batching.packed: true to pack documents",
    ),
    (
        lambda c: c["batching"].update(packed=True, buckets=[64]),
        "batching.buckets: a TokenBudget option, not used with packed: true",
    ),
    (
        lambda c: c["batching"].update(packed=True, max_wait=2),
        "batching.max_wait: a TokenBudget option, not used with packed: true",
    ),
    (
        lambda c: c["batching"].update(packed=True, seq_length=5),
        "batching.seq_length: unknown key; did you mean 'seq_len'?",
    ),
    (lambda c: c["batching"].update(packed=True) or c["batching"].pop("max_tokens"), "batching.max_tokens: required"),
    (lambda c: c["batching"].update(packed=True, max_tokens=0), "batching.max_tokens: must be >= 1, got 0"),
    (lambda c: c["batching"].update(packed=True, seq_len=5000), "batching.seq_len: must be <= 4096, got 5000"),
    (lambda c: c["batching"].update(packed=True, seq_len=0), "batching.seq_len: must be >= 1, got 0"),
    (
        lambda c: c["batching"].update(packed=True, split_documents="no"),
        "batching.split_documents: must be true or false, got 'no'",
    ),
    (
        lambda c: c["batching"].update(packed=True, seq_len=512, max_length=1000),
        "batching.max_length: must be <= seq_len (512) unless split_documents is true, got 1000",
    ),
    (
        lambda c: c["batching"].update(packed=True, max_length=5000),
        "batching.max_length: must be <= max_tokens (4096) unless split_documents is true, got 5000",
    ),
    (
        lambda c: c["batching"].update(packed=True, split_documents=True, max_length=0),
        "batching.max_length: must be >= 1, got 0",
    ),
    (
        lambda c: c["batching"].update(packed=True, overlong="cut"),
        "batching.overlong: must be one of 'truncate', 'drop', got 'cut'",
    ),
    (lambda c: c["batching"].update(packed=True, open_batches=0), "batching.open_batches: must be >= 1, got 0"),
    # fields
    (_set("fields", []), "fields: must be a mapping, got [] (list)"),
    (_set("fields", {}), "fields: must name at least one field, got {}"),
    (_set("fields", {"a b": {}}), "fields.a b: a field name must be an identifier, got 'a b'"),
    (
        _set("fields", {"lengths": {}}),
        "fields.lengths: collides with a view every batch has (source, lengths, <field>_lengths)",
    ),
    (
        _set("fields", {"text": {}, "text_lengths": {}}),
        "fields.text_lengths: collides with a view every batch has (source, lengths, <field>_lengths)",
    ),
    (_set("fields", {"text": "int32"}), "fields.text: must be a mapping, got 'int32'"),
    (_set("fields", {"text": None}), "fields.text: must be a mapping, got None (NoneType)"),
    (_set("fields", {"text": {"dtyp": "int32"}}), "fields.text.dtyp: unknown key; did you mean 'dtype'?"),
    (
        _set("fields", {"text": {"dtype": "bfloat61"}}),
        "fields.text.dtype: must be one of 'int8', 'int16', 'int32', 'int64', 'uint8', "
        "'float16', 'bfloat16', 'float32', 'float64', got 'bfloat61'; did you mean 'bfloat16'?",
    ),
    (
        _set("fields", {"text": {"feature_shape": [80, 0]}}),
        "fields.text.feature_shape[1]: must be >= 1, got 0",
    ),
    (_set("fields", {"text": {"pad": 0.5}}), "fields.text.pad: 0.5 is not representable as int32"),
    (_set("fields", {"text": {"dtype": "uint8", "pad": -1}}), "fields.text.pad: -1 is not representable as uint8"),
    (
        _set("fields", {"text": {"dtype": "int64", "pad": 2**70}}),
        "fields.text.pad: 1180591620717411303424 is not representable as int64",
    ),
    (
        _set("fields", {"audio": {"dtype": "float16", "pad": 1e10}}),
        "fields.audio.pad: 10000000000.0 is not representable as float16",
    ),
    (_set("fields", {"text": {"pad": float("nan")}}), "fields.text.pad: nan is not representable as int32"),
    (_set("fields", {"text": {"pad": "x"}}), "fields.text.pad: must be a number, got 'x'"),
    (_set("fields", {"text": {"pad": True}}), "fields.text.pad: must be a number, got True"),
    (
        lambda c: c.update(fields={"text": {}}, batching={"packed": True, "max_tokens": 64}),
        "fields: multi-field samples are batched by a token budget (padded per field), not with batching.packed: true",
    ),
    # schedule
    (_set("schedule", [1]), "schedule: must be a mapping, got [1] (list)"),
    (_set("schedule.temprature", 2), "schedule.temprature: unknown key; did you mean 'temperature'?"),
    (_set("schedule.temperature", 0), "schedule.temperature: must be > 0, got 0"),
    (
        _set("schedule.temperature", "hot"),
        "schedule.temperature: must be a number or a mapping with 'start', got 'hot'",
    ),
    (_set("schedule.temperature", {"end": 1}), "schedule.temperature.start: required"),
    (
        _set("schedule.temperature", {"start": 5, "shape": "cos"}),
        "schedule.temperature.shape: must be one of 'constant', 'linear', 'cosine', 'step', got 'cos'; did you mean "
        "'cosine'?",
    ),
    (
        _set("schedule.temperature", {"start": 5, "end": 1}),
        "schedule.temperature.end: only used with a non-constant shape (linear, cosine, step); shape is 'constant'",
    ),
    (
        _set("schedule.temperature", {"start": 5, "shape": "linear", "steps": 9}),
        "schedule.temperature.end: required with shape 'linear'",
    ),
    (
        _set("schedule.temperature", {"start": 5, "end": 1, "shape": "linear"}),
        "schedule.temperature: shape 'linear' needs exactly one of 'steps' or 'tokens' (its length)",
    ),
    (
        _set("schedule.temperature", {"start": 5, "end": 1, "shape": "linear", "steps": 0}),
        "schedule.temperature.steps: must be >= 1, got 0",
    ),
    (
        _set("schedule.temperature", {"start": 5, "end": 1, "shape": "linear", "tokens": -1}),
        "schedule.temperature.tokens: must be > 0, got -1",
    ),
    (
        _set("schedule.temperature", {"start": 5, "base": "size"}),
        "schedule.temperature.base: must be one of 'sizes', 'weights', got 'size'; did you mean 'sizes'?",
    ),
    (
        _set("schedule.temperature", {"start": 5, "stop": 1}),
        "schedule.temperature.stop: unknown key; did you mean 'steps'?",
    ),
    (_set("schedule.min_prob", 1.5), "schedule.min_prob: must be <= 1, got 1.5"),
    (_set("schedule.min_prob", 0.5), "schedule.min_prob: 0.5 * 3 sources = 1.5 exceeds 1"),
    (_set("schedule.hierarchical", {"beta_group": 0.5}), "schedule.hierarchical.beta_source: required"),
    (
        _set("schedule.hierarchical", {"beta_group": 0.5, "beta_source": -1}),
        "schedule.hierarchical.beta_source: must be >= 0, got -1",
    ),
    (
        _set("schedule.hierarchical", {"beta_corpus": 0.5}),
        "schedule.hierarchical.beta_corpus: unknown key; did you mean 'beta_group'?",
    ),
    (
        lambda c: c.update(schedule={"hierarchical": {"beta_group": 1, "beta_source": 1}, "temperature": 2}),
        "schedule.hierarchical: cannot be combined with 'temperature'",
    ),
    (
        lambda c: c.update(schedule={"hierarchical": {"beta_group": 1, "beta_source": 1}, **PHASES}),
        "schedule.hierarchical: cannot be combined with 'phases'",
    ),
    (_set("schedule.weights", [1, 2]), "schedule.weights: must be a mapping, got [1, 2] (list)"),
    (_set("schedule.weights", {}), "schedule.weights: must name at least one source, got {}"),
    (_set("schedule.weights", {"a": 1, "d": 1}), "schedule.weights.d: unknown source (sources: a, b, c)"),
    (_set("schedule.weights", {"a": -1}), "schedule.weights.a: must be >= 0, got -1"),
    (
        _set("schedule.weights", {"a": 0, "b": 0}),
        "schedule.weights: at least one weight must be > 0, got {'a': 0.0, 'b': 0.0}",
    ),
    (
        lambda c: c.update(schedule={"weights": {"a": 1}, **PHASES}),
        "schedule.weights: cannot be combined with 'phases' (each phase has its own weights)",
    ),
    (
        lambda c: c.update(schedule={"weights": {"a": 1}, "temperature": 2}),
        "schedule.weights: cannot be combined with 'temperature' (for a temperature over these weights, give one "
        "phase with both)",
    ),
    (
        lambda c: c.update(schedule={"weights": {"a": 1}, "hierarchical": {"beta_group": 1, "beta_source": 1}}),
        "schedule.weights: cannot be combined with 'hierarchical' (it sets the weights from sizes)",
    ),
    # phases
    (_set("schedule.phases", []), "schedule.phases: must be a non-empty list of phases, got [] (list)"),
    (_set("schedule.phases", [3]), "schedule.phases[0]: must be a mapping, got 3"),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][1].update(until_token=5),
        "schedule.phases[1].until_token: unknown key; did you mean 'until_tokens'?",
    ),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][1].pop("until_tokens"),
        "schedule.phases[1].until_tokens: required (only the last phase may omit it)",
    ),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][2].update(until_tokens=300),
        "schedule.phases[2].until_tokens: the last phase runs to the end of training; remove it",
    ),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][1].update(until_tokens=100),
        "schedule.phases[1].until_tokens: must be greater than schedule.phases[0].until_tokens (100), got 100",
    ),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][0].update(until_tokens=-1),
        "schedule.phases[0].until_tokens: must be > 0, got -1",
    ),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][2].update(ramp_steps=5),
        "schedule.phases[2].ramp_steps: phases count tokens (schedule.phases[0].until_tokens); don't mix steps and "
        "tokens",
    ),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][0].update(ramp_tokens=5),
        "schedule.phases[0].ramp_tokens: the first phase has nothing to ramp from; must be 0, got 5",
    ),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][1].update(ramp_tokens=101),
        "schedule.phases[1].ramp_tokens: must be <= the phase's length (100), got 101",
    ),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][1].update(ramp_tokens=-1),
        "schedule.phases[1].ramp_tokens: must be >= 0, got -1",
    ),
    (
        lambda c: c.update(schedule={"phases": [{"until_steps": 10.5}, {}]}),
        "schedule.phases[0].until_steps: must be an integer, got 10.5",
    ),
    (
        lambda c: c.update(schedule=copy.deepcopy(PHASES)) or c["schedule"]["phases"][0].update(weights={"bookz": 1}),
        "schedule.phases[0].weights.bookz: unknown source (sources: a, b, c)",
    ),
    (
        lambda c: c.update(schedule={"phases": [{"weights": {"a": 1, "bb": 2}}]}),
        "schedule.phases[0].weights.bb: unknown source; did you mean 'b'?",
    ),
    (
        lambda c: c.update(schedule={"phases": [{"weights": {"a": -1}}]}),
        "schedule.phases[0].weights.a: must be >= 0, got -1",
    ),
    (
        lambda c: c.update(schedule={"phases": [{"weights": {"a": 0}}]}),
        "schedule.phases[0].weights: at least one weight must be > 0, got {'a': 0.0}",
    ),
    (
        lambda c: c.update(schedule={"phases": [{"weights": {}}]}),
        "schedule.phases[0].weights: must name at least one source, got {}",
    ),
    (
        lambda c: c.update(schedule={"phases": [{"weights": [1, 2]}]}),
        "schedule.phases[0].weights: must be a mapping, got [1, 2] (list)",
    ),
    (
        lambda c: c.update(
            schedule={
                "phases": [{"until_tokens": 10}, {"temperature": {"start": 2, "end": 1, "shape": "linear", "steps": 5}}]
            }
        ),
        "schedule.phases[1].temperature.steps: a phase's temperature counts from the phase's start, and these phases "
        "count tokens; give its length as 'tokens'",
    ),
    (
        lambda c: c.update(schedule={"phases": [{"weights": {"a": 1}, "temperature": {"start": 2, "base": "sizes"}}]}),
        "schedule.phases[0].temperature.base: 'sizes' would ignore this phase's weights; use 'weights' or omit it",
    ),
    (
        lambda c: c.update(
            schedule={
                "temperature": {"start": 2, "base": "sizes"},
                "phases": [{"until_steps": 5}, {"weights": {"a": 1}}],
            }
        ),
        "schedule.temperature.base: 'sizes' would ignore the weights of schedule.phases[1]; use 'weights' or omit it",
    ),
    # NeMo keys
    (
        _set("sampling_technique", "uniform"),
        "sampling_technique: must be one of 'temperature', 'random', 'round-robin', got 'uniform'",
    ),
    (
        _set("concat_sampling_technique", "round_robin"),
        "concat_sampling_technique: must be one of 'temperature', 'random', 'round-robin', got 'round_robin'; did you "
        "mean 'round-robin'?",
    ),
    (
        lambda c: c.update(sampling_temperature=2, concat_sampling_temperature=2),
        "concat_sampling_temperature: the same setting as 'sampling_temperature'; give only one",
    ),
    (
        lambda c: c.update(seed=1, concat_sampling_seed=1),
        "concat_sampling_seed: the same setting as 'seed'; give only one",
    ),
    (_set("sampling_temperature", 0), "sampling_temperature: must be > 0, got 0"),
    (
        _set("concat_sampling_scale", 2),
        (
            "concat_sampling_scale: only 1 is supported, got 2: NeMo multiplies its epoch length by it, but a mixture "
            "streams without an epoch length; bound the run in the training loop (or `mixer run --steps N`), or use "
            "stop: all_exhausted for exactly one pass over every source"
        ),
    ),
    (_set("sampling_scale", 0), "sampling_scale: must be > 0, got 0"),
    (
        lambda c: c.update(sampling_technique="temperature", schedule={"temperature": 2}),
        "schedule: conflicts with sampling_technique: 'temperature'; NeMo's keys set the target shares, use one or "
        "the other",
    ),
    (
        lambda c: c.update(concat_sampling_temperature=2, schedule={"min_prob": 0.1}),
        "schedule: conflicts with concat_sampling_temperature (NeMo's default sampling_technique is 'temperature'); "
        "NeMo's keys set the target shares, use one or the other",
    ),
    (
        lambda c: c.update(sampling_technique="random", sampling_temperature=5),
        "sampling_temperature: only used with sampling_technique 'temperature' (NeMo ignores it with 'random'); "
        "remove it",
    ),
    (
        lambda c: c.update(concat_sampling_probabilities=[0.2, 0.3, 0.5]),
        "concat_sampling_probabilities: only used with sampling_technique 'random' (NeMo ignores it with "
        "'temperature'); remove it",
    ),
    (
        lambda c: c.update(sampling_technique="random", sampling_probabilities=[0.5, 0.5]),
        "sampling_probabilities: must be a list of 3 probabilities (one per source, in order), got [0.5, 0.5] (list)",
    ),
    (
        lambda c: c.update(sampling_technique="random", sampling_probabilities=[0.5, 0.5, 0.5]),
        "sampling_probabilities: must sum to 1 (as NeMo requires), got [0.5, 0.5, 0.5] (sum 1.5)",
    ),
    (
        lambda c: c.update(sampling_technique="random", sampling_probabilities=[0.5, 0.6, -0.1]),
        "sampling_probabilities[2]: must be >= 0, got -0.1",
    ),
    (
        lambda c: (
            c.update(sampling_technique="random", sampling_probabilities=[0.5, 0.25, 0.25])
            or c["sources"][1].update(weight=2)
        ),
        "sources[1].weight: conflicts with sampling_probabilities, which sets every source's weight",
    ),
    (
        lambda c: c.update(sampling_technique="round-robin", selector="deficit"),
        "selector: conflicts with sampling_technique: 'round-robin', which means selector 'round_robin'; give one",
    ),
    (_set("shuffle", "yes"), "shuffle: must be true or false, got 'yes'"),
    (lambda c: c.update(shuffle=False, shuffle_buffer=100), "shuffle_buffer: conflicts with shuffle: false, got 100"),
    (
        lambda c: c.update(concat_shuffle=True, shuffle_buffer=0),
        "shuffle_buffer: 0 does not shuffle, but concat_shuffle is true",
    ),
]


@pytest.mark.parametrize("mutate,message", ERRORS, ids=[m for _, m in ERRORS])
def test_validation_errors(mutate, message):
    cfg = small()
    mutate(cfg)
    with pytest.raises(ConfigError) as exc:
        parse_config(cfg)
    assert str(exc.value) == message


def test_not_a_mapping():
    with pytest.raises(ConfigError, match=r"^config: must be a mapping, got \[1, 2\] \(list\)$"):
        parse_config([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^config: keys must be strings, got 1$"):
        parse_config({1: 2})  # type: ignore[dict-item]


def test_file_errors_name_the_file(tmp_path):
    path = write(tmp_path, ISSUE_YAML.replace("weight: 0.1,", "weight: -1,"))
    with pytest.raises(ConfigError) as exc:
        parse_config(path)
    assert str(exc.value) == f"{path}: sources[2].weight: must be >= 0, got -1"
    dup = write(tmp_path, "seed: 1\nbatching: {max_tokens: 5}\nseed: 2\n", "dup.yaml")
    with pytest.raises(ConfigError) as exc:
        parse_config(dup)
    assert str(exc.value) == f"{dup}: line 3: duplicate key 'seed'"
    bad = write(tmp_path, "sources: [\n", "bad.yaml")
    with pytest.raises(ConfigError, match=rf"^{re.escape(bad)}: not valid YAML"):
        parse_config(bad)
    with pytest.raises(FileNotFoundError):
        parse_config(str(tmp_path / "missing.yaml"))


def test_yaml_is_loaded_safely(tmp_path):
    path = write(tmp_path, "seed: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config(path)


def test_yaml_numbers(tmp_path):
    text = "a: 1e12\nb: 2.0e11\nc: -1.5E-3\nd: .5e2\ne: 1_000\nf: '1e5'\ng: 1.0\nh: 12\n"
    path = write(tmp_path, text)
    from mixer.config.mixture_config import read_yaml

    assert read_yaml(path) == {"a": 1e12, "b": 2e11, "c": -1.5e-3, "d": 50.0, "e": 1000, "f": "1e5", "g": 1.0, "h": 12}


# ------------------------------------------------------------------------------------------- NeMo


def test_nemo_temperature_is_the_default_technique():
    # Any sampling_* key brings NeMo's defaults: technique temperature, temperature 5, on sizes.
    spec = parse_config(small(sampling_technique="temperature"))
    assert spec.schedule == Temperature(5.0, base="sizes") and spec.selector == "deficit"
    assert parse_config(small(concat_sampling_temperature=1.0)).schedule == Temperature(1.0, base="sizes")
    assert parse_config(small(sampling_scale=1)).schedule == Temperature(5.0, base="sizes")
    # ... and the selector may be set, e.g. to NeMo's independent random draws.
    assert parse_config(small(concat_sampling_technique="temperature", selector="random")).selector == "random"
    # Without any sampling_* key, mixer's own default (static weights) holds.
    assert parse_config(small(shuffle=True)).schedule is None


def test_nemo_random_and_round_robin():
    spec = parse_config(small(concat_sampling_technique="random", concat_sampling_probabilities=[0.5, 0.3, 0.2]))
    assert spec.selector == "random" and spec.schedule is None
    assert [s.weight for s in spec.sources] == [0.5, 0.3, 0.2]
    uniform = parse_config(small(sampling_technique="random", sampling_probabilities=None))
    assert uniform.selector == "random" and [s.weight for s in uniform.sources] == [1.0, 1.0, 1.0]
    rr = parse_config(small(concat_sampling_technique="round-robin", selector="round_robin"))
    assert rr.selector == "round_robin" and rr.schedule is None


def test_nemo_shuffle_and_seed():
    assert parse_config(small(concat_shuffle=False)).shuffle_buffer == 0
    assert parse_config(small(shuffle=False, shuffle_buffer=1)).shuffle_buffer == 1
    assert parse_config(small(shuffle=True)).shuffle_buffer == 1000
    assert parse_config(small(shuffle=True, shuffle_buffer=2048)).shuffle_buffer == 2048
    assert parse_config(small(concat_sampling_seed=1234)).seed == 1234
    assert parse_config(small(concat_sampling_seed=None)).seed == 0  # NeMo's None (unseeded) → mixer's 0
    assert parse_config(small(seed=None)).seed == 0


def test_nemo_prefixed_and_plain_keys_mean_the_same():
    for plain, prefixed in NEMO_KEYS.items():
        value = {
            "sampling_technique": "random",
            "sampling_temperature": 2.0,
            "sampling_probabilities": None,
            "sampling_scale": 1,
            "shuffle": False,
            "seed": 9,
        }[plain]
        assert parse_config(small(**{plain: value})) == parse_config(small(**{prefixed: value}))


# --------------------------------------------------------------------------------------- examples


def test_examples_parse():
    paths = sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml")))
    assert {os.path.basename(p) for p in paths} >= {
        "pretrain.yaml",
        "continued_pretraining.yaml",
        "nemo_asr_concat.yaml",
    }
    for path in paths:
        spec = parse_config(path)
        assert parse_config(spec.to_dict()) == spec


def test_example_contents():
    cpt = parse_config(os.path.join(EXAMPLES, "continued_pretraining.yaml"))
    info = SourceInfo(
        names=tuple(s.name for s in cpt.sources), weights=np.ones(4), sizes=np.ones(4), groups=(None,) * 4
    )
    p = cpt.schedule.probs(info, 0, 1e12)
    assert p[0] == pytest.approx(0.7) and p[1:].sum() == pytest.approx(0.3)  # the example: 70 / 30
    nemo = parse_config(os.path.join(EXAMPLES, "nemo_asr_concat.yaml"))
    assert nemo.schedule == Temperature(1.0, base="sizes") and nemo.seed == 1234 and nemo.shuffle_buffer == 2048
    assert nemo.sources[0].decode == ImportPath("my_asr.data:decode_audio")  # imported by build_mixture


# ------------------------------------------------------------------------------- imports and build


def test_resolve_import():
    import json

    assert resolve_import("json:loads", "x") is json.loads
    assert resolve_import("os.path:join", "x") is os.path.join
    with pytest.raises(
        ConfigError, match=r"^sources\[0\].decode: cannot import module 'no_such_mod' \(ModuleNotFoundError: "
    ):
        resolve_import("no_such_mod:f", "sources[0].decode")
    with pytest.raises(ConfigError, match=r"^sources\[0\].decode: 'json' has no attribute 'nope'$"):
        resolve_import("json:nope", "sources[0].decode")
    with pytest.raises(ConfigError, match=r"^sources\[0\].length: 'math:pi' is not callable, got 3.14"):
        resolve_import("math:pi", "sources[0].length")
    with pytest.raises(ConfigError, match=r"^x: must be an import path 'package.module:function', got 'json.loads'$"):
        resolve_import("json.loads", "x")


def _core_available() -> bool:
    try:
        from mixer import Mixture, Source, TokenBudget  # noqa: F401
    except ImportError:
        return False
    return True


needs_core = pytest.mark.skipif(not _core_available(), reason="mixer.Mixture is not importable yet")


@needs_core
def test_build_mixture_from_yaml(tmp_path, three_sources):
    import mixer

    text = f"""
    seed: 5
    batching: {{max_tokens: 16384, multiple_of: 2, max_length: 16384}}
    sources:
      - {{name: web,   urls: "{three_sources["web"][0]}",   weight: 0.5, size: 1.0e6, group: en}}
      - {{name: code,  urls: "{three_sources["code"][0]}",  weight: 0.3, size: 2.0e5,
         decode: "mixer.read.decode:default_tokens"}}
      - {{name: books, urls: "{three_sources["books"][0]}", weight: 0.2, size: 4.0e5, group: en, on_error: skip}}
    schedule:
      phases:
        - {{until_steps: 10, weights: {{web: 1, code: 1}}}}
        - {{weights: {{books: 1}}, ramp_steps: 10}}
      min_prob: 0.1
    selector: random
    stop: first_exhausted
    shuffle_buffer: 16
    """
    mix = load_config(write(tmp_path, text), rank=0, world_size=1)
    assert isinstance(mix, mixer.Mixture)
    assert [s.name for s in mix.sources] == ["web", "code", "books"]
    assert [s.weight for s in mix.sources] == [0.5, 0.3, 0.2]
    assert [s.group for s in mix.sources] == ["en", None, "en"]
    assert mix.sources[1].decode is mixer.read.decode.default_tokens and mix.sources[0].decode is None
    assert mix.sources[2].on_error == "skip"
    assert mix.sizes == {"web": 1e6, "code": 2e5, "books": 4e5}
    assert (mix.selector, mix.stop, mix.seed, mix.shuffle_buffer) == ("random", "first_exhausted", 5, 16)
    assert mix.batching == mixer.TokenBudget(max_tokens=16384, multiple_of=2, max_length=16384)
    assert mix.schedule == parse_config(write(tmp_path, text, "again.yaml")).schedule
    assert mix.target_at(0, 0).tolist() == pytest.approx([0.45, 0.45, 0.1])
    assert mix.target_at(15, 0).tolist() == pytest.approx([0.25, 0.25, 0.5])  # halfway up the ramp
    batch = next(iter(mix))
    assert isinstance(batch, mixer.Batch) and batch.tokens.numel() <= 16384


@needs_core
def test_schedule_weights_in_yaml_gives_the_targets_of_mixer_weights(tmp_path, three_sources):
    # schedule.weights is mixer.Weights: fixed weights by name, replacing the sources' own (a source
    # not named gets 0), floored like any schedule. Same targets from a file and from code.
    import mixer

    text = f"""
    batching: {{max_tokens: 16384, max_length: 16384}}
    sources:
      - {{name: web,   urls: "{three_sources["web"][0]}",   weight: 0.9}}
      - {{name: code,  urls: "{three_sources["code"][0]}",  weight: 0.05}}
      - {{name: books, urls: "{three_sources["books"][0]}", weight: 0.05}}
    schedule:
      weights: {{books: 3, web: 1}}
      min_prob: 0.1
    """
    from_yaml = load_config(write(tmp_path, text))
    assert from_yaml.schedule == Floored(Weights({"books": 3.0, "web": 1.0}), 0.1)
    srcs = [mixer.Source(s.name, s.urls, weight=s.weight) for s in from_yaml.sources]
    in_code = mixer.Mixture(
        srcs,
        batching=mixer.TokenBudget(max_tokens=16384, max_length=16384),
        schedule=mixer.Floored(mixer.Weights({"books": 3, "web": 1}), 0.1),
    )
    # By hand: (web, code, books) = (1, 0, 3) / 4, then code lifted to 0.1 and the rest scaled by 0.9.
    want = [0.25 * 0.9, 0.1, 0.75 * 0.9]
    for step in (0, 1000, 10**6):
        assert from_yaml.target_at(step, step * 16384.0).tolist() == pytest.approx(want, abs=1e-12)
        assert in_code.target_at(step, step * 16384.0).tolist() == from_yaml.target_at(step, step * 16384.0).tolist()


@needs_core
def test_build_mixture_errors(tmp_path, three_sources):
    cfg = {
        "batching": {"max_tokens": 16384},
        "sources": [{"name": "web", "urls": three_sources["web"][0], "decode": "no_such_module:decode"}],
    }
    with pytest.raises(ConfigError, match=r"^sources\[0\].decode: cannot import module 'no_such_module'"):
        load_config(cfg)
    cfg["sources"][0].pop("decode")
    cfg["sources"][0]["urls"] = str(tmp_path / "nothing-{0..3}.tar")
    with pytest.raises(MixerError, match=r"source 'web'"):
        load_config(cfg)


@needs_core
def test_build_mixture_passes_every_batching_option(three_sources):
    spec = parse_config(
        {
            "batching": {
                "max_tokens": 16384,
                "buckets": [512, 2048, 16384],
                "max_batch_size": 64,
                "multiple_of": 4,
                "max_length": 16384,
                "overlong": "drop",
                "num_buckets": 4,
                "max_bucket_ratio": 1.5,
            },
            "sources": [{"name": "web", "urls": three_sources["web"][0]}],
            "unit": "samples",
            "mix": "sample",
            "pad_id": 7,
            "dtype": "int64",
        }
    )
    mix = build_mixture(spec, rank=0, world_size=1)
    import mixer

    assert mix.batching == mixer.TokenBudget(
        max_tokens=16384,
        buckets=(512, 2048, 16384),
        max_batch_size=64,
        multiple_of=4,
        max_length=16384,
        overlong="drop",
        num_buckets=4,
        max_bucket_ratio=1.5,
    )
    assert (mix.unit, mix.mix, mix.pad_id, mix.dtype, mix.schedule) == ("samples", "sample", 7, "int64", Static())


def decode_halves(raw: dict[str, Any]) -> dict[str, np.ndarray]:
    """A config's decode (``test_config:decode_halves``): the tokens, and their first half, as fields."""
    from mixer.read.decode import default_tokens

    tokens = default_tokens(raw)
    return {"text": tokens, "head": tokens[: (len(tokens) + 1) // 2]}


@needs_core
def test_build_mixture_with_fields_a_field_length_and_state_every(three_sources):
    import torch

    import mixer

    spec = parse_config(
        {
            "batching": {"max_tokens": 4096, "max_wait": 3},
            "sources": [
                {
                    "name": "web",
                    "urls": three_sources["web"][0],
                    "decode": "test_config:decode_halves",
                    "length": "head",
                }
            ],
            "fields": {"text": {"dtype": "int64", "pad": -1}, "head": {"pad": 0}},
            "state_every": 5,
        }
    )
    mix = build_mixture(spec, rank=0, world_size=1)
    assert mix.sources[0].length == "head" and mix.sources[0].decode.__name__ == "decode_halves"
    assert mix.batching == mixer.TokenBudget(max_tokens=4096, max_wait=3) and mix.state_every == 5
    batch = next(iter(mix))
    assert isinstance(batch, mixer.FieldBatch)
    assert batch["text"].dtype == torch.int64 and batch["head"].dtype == torch.int32
    assert torch.equal(batch.lengths, batch["head_lengths"])  # the field that length names counts
    assert torch.equal(batch["head_lengths"], (batch["text_lengths"] + 1) // 2)
    for i, n in enumerate(batch["text_lengths"].tolist()):
        assert torch.all(batch["text"][i, n:] == -1)
        assert torch.equal(batch["head"][i, : (n + 1) // 2].long(), batch["text"][i, : (n + 1) // 2])


@needs_core
def test_build_mixture_packed(three_sources):
    import mixer

    sources = [{"name": n, "urls": three_sources[n][0]} for n in ("web", "books")]
    batching = {
        "packed": True,
        "max_tokens": 8192,
        "seq_len": 2048,
        "split_documents": True,
        "max_length": 12000,
        "overlong": "drop",
        "open_batches": 2,
    }
    mix = build_mixture(parse_config({"batching": batching, "sources": sources}), rank=0, world_size=1)
    assert mix.batching == mixer.Packed(
        8192, seq_len=2048, split_documents=True, max_length=12000, overlong="drop", open_batches=2
    )
    batch = next(iter(mix))
    assert isinstance(batch, mixer.PackedBatch)
    assert batch.tokens.numel() <= 8192 and batch.tokens.numel() % 2048 == 0
    # Options left out take the library's defaults (open_batches=4, flat, no splitting).
    flat = build_mixture(
        parse_config({"batching": {"packed": True, "max_tokens": 16384}, "sources": sources}), rank=0, world_size=1
    )
    assert flat.batching == mixer.Packed(16384)


def test_dtypes_match_the_core():
    from mixer.spec.dtypes import _DTYPES

    # The Mixture's own check decides (mixer.mixing.mixture.check_options): every core dtype is a config value.
    assert [parse_config(small(dtype=d)).dtype for d in _DTYPES] == list(_DTYPES)


def test_hierarchical_from_config_uses_groups():
    spec = parse_config(
        small(
            sources=[
                {"name": "ls-eng", "urls": "/a.tar", "size": 960.5, "group": "librispeech"},
                {"name": "cv-eng", "urls": "/b.tar", "size": 1500.2, "group": "commonvoice"},
                {"name": "cv-fra", "urls": "/c.tar", "size": 450.8, "group": "commonvoice"},
            ],
            schedule={"hierarchical": {"beta_group": 0.5, "beta_source": 0.5}, "min_prob": 0.2},
        )
    )
    assert spec.schedule == Floored(Hierarchical(0.5, 0.5), 0.2)
    assert [s.group for s in spec.sources] == ["librispeech", "commonvoice", "commonvoice"]
