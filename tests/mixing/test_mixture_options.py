"""The Mixture's options table (`mixer.mixing.options.OPTIONS`): the Mixture's signature, its check,
the config file and the fingerprint all agree with it."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from shardutil import write_token_shards

import mixer
from mixer.errors import ConfigError
from mixer.mixing.options import OPTIONS, STREAM_OPTIONS

PARTS = {"sources", "batching", "schedule", "fields"}  # configured objects that describe themselves
DEPLOYMENT = {"rank", "world_size", "dp_group"}


def test_the_table_is_the_mixtures_options_with_its_defaults() -> None:
    params = inspect.signature(mixer.Mixture).parameters
    assert set(params) - PARTS - DEPLOYMENT == set(OPTIONS)
    assert {name: params[name].default for name in OPTIONS} == {name: o.default for name, o in OPTIONS.items()}
    config = {f.name: f.default for f in mixer.MixtureConfig.__dataclass_fields__.values() if f.name in OPTIONS}
    assert config == {name: o.default for name, o in OPTIONS.items()}
    assert STREAM_OPTIONS == tuple(n for n in OPTIONS if n not in ("profile_cache", "profile_share"))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_code_and_config_refuse_a_bad_value_alike(name: str) -> None:
    sources, batching = (mixer.Source("a", "/nowhere/a.tar"),), mixer.TokenBudget(64)
    bad = 2.5 if name not in ("profile_cache", "profile_share") else 3
    with pytest.raises(ConfigError) as from_config:
        mixer.MixtureConfig(sources=sources, batching=batching, **{name: bad})
    with pytest.raises(ConfigError) as from_code:
        mixer.Mixture(list(sources), batching=batching, **{name: bad})  # refused before any shard is listed
    assert str(from_code.value) == str(from_config.value)
    assert name in str(from_code.value) and str(bad) in str(from_code.value)


# Another valid value of each option: the ones that decide the stream change the fingerprint.
OTHER: dict[str, Any] = {
    "selector": "random",
    "unit": "samples",
    "mix": "sample",
    "stop": "first_exhausted",
    "seed": 1,
    "shuffle_buffer": 10,
    "pad_id": -1,
    "dtype": "int64",
    "state_every": 8,
    "buffer_budget": None,
    "profile_share": False,
}


def test_the_fingerprint_holds_every_option_that_decides_the_stream_and_no_other(tmp_path: Path) -> None:
    assert set(OTHER) | {"profile_cache"} == set(OPTIONS)
    sources = [
        mixer.Source("a", write_token_shards(tmp_path / "a", "a", [[5, 9, 12], [7, 3]])),
        mixer.Source("b", write_token_shards(tmp_path / "b", "b", [[4, 30], [8]])),
    ]

    def fingerprint(**options: Any) -> str:
        return mixer.Mixture(sources, batching=mixer.TokenBudget(64), **options).fingerprint

    base = fingerprint()
    changed = {name for name, value in OTHER.items() if fingerprint(**{name: value}) != base}
    assert changed == set(STREAM_OPTIONS)
    assert fingerprint(profile_cache=str(tmp_path / "cache")) == base
