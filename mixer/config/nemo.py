"""NeMo's ``ConcatDataset`` settings in a config file, translated to the mixture's own: the sampling
technique, temperature and probabilities become a schedule or a selector, ``shuffle`` and ``seed``
the mixture's options; each error names the key as given (plain or ``concat_``-prefixed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mixer import _check
from mixer.errors import ConfigError
from mixer.mixing.schedule import Temperature
from mixer.spec.source import Source

#: NeMo ``ConcatDataset`` argument → the key of NeMo's ASR configs (``get_concat_*_dataset``).
NEMO_KEYS: dict[str, str] = {
    "sampling_technique": "concat_sampling_technique",
    "sampling_temperature": "concat_sampling_temperature",
    "sampling_probabilities": "concat_sampling_probabilities",
    "sampling_scale": "concat_sampling_scale",
    "shuffle": "concat_shuffle",
    "seed": "concat_sampling_seed",
}
NEMO_TECHNIQUES = ("temperature", "random", "round-robin")
NEMO_DEFAULT_TEMPERATURE = 5.0


def nemo_values(m: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """NeMo setting → (the key it was given as, value), for settings given a non-null value."""
    out: dict[str, tuple[str, Any]] = {}
    for plain, prefixed in NEMO_KEYS.items():
        given = [k for k in (plain, prefixed) if k in m and m[k] is not None]
        if len(given) == 2:
            raise ConfigError(f"{prefixed}: the same setting as '{plain}'; give only one")
        if given:
            out[plain] = (given[0], m[given[0]])
    return out


def apply_nemo(
    m: Mapping[str, Any], nemo: dict[str, tuple[str, Any]], sources: list[Source], explicit_weight: list[bool]
) -> dict[str, Any]:
    """Translate NeMo's sampling keys; returns the native settings they imply."""
    out: dict[str, Any] = {}
    if "sampling_scale" in nemo:
        key, value = nemo["sampling_scale"]
        if _check.number(value, key, minimum=0, strict=True) != 1:
            raise ConfigError(
                f"{key}: only 1 is supported, got {value!r}: NeMo multiplies its epoch length by it, but a mixture "
                "streams without an epoch length; bound the run in the training loop (or `mixer run --steps N`), "
                "or use stop: all_exhausted for exactly one pass over every source"
            )
    sampling = [
        k
        for k in ("sampling_technique", "sampling_temperature", "sampling_probabilities", "sampling_scale")
        if k in nemo
    ]
    if not sampling:
        return out
    if "sampling_technique" in nemo:
        key, value = nemo["sampling_technique"]
        technique = _check.choice(value, key, NEMO_TECHNIQUES)
        given = f"{key}: {technique!r}"
    else:
        technique, given = "temperature", f"{nemo[sampling[0]][0]} (NeMo's default sampling_technique is 'temperature')"
    if "schedule" in m and m["schedule"] is not None:
        raise ConfigError(f"schedule: conflicts with {given}; NeMo's keys set the target shares, use one or the other")
    if technique != "temperature" and "sampling_temperature" in nemo:
        key = nemo["sampling_temperature"][0]
        raise ConfigError(
            f"{key}: only used with sampling_technique 'temperature' (NeMo ignores it with {technique!r}); remove it"
        )
    if technique != "random" and "sampling_probabilities" in nemo:
        key = nemo["sampling_probabilities"][0]
        raise ConfigError(
            f"{key}: only used with sampling_technique 'random' (NeMo ignores it with {technique!r}); remove it"
        )
    if technique == "temperature":
        t = NEMO_DEFAULT_TEMPERATURE
        if "sampling_temperature" in nemo:
            key, value = nemo["sampling_temperature"]
            t = float(_check.number(value, key, minimum=0, strict=True))
        out["schedule"] = Temperature(t, base="sizes")
        return out
    selector = "random" if technique == "random" else "round_robin"
    if "selector" in m and m["selector"] != selector:
        raise ConfigError(f"selector: conflicts with {given}, which means selector {selector!r}; give one")
    out["selector"] = selector
    if "sampling_probabilities" in nemo:
        key, value = nemo["sampling_probabilities"]
        if not isinstance(value, list) or len(value) != len(sources):
            raise ConfigError(
                f"{key}: must be a list of {len(sources)} probabilities (one per source, in order), got "
                f"{_check.show(value)}"
            )
        probs = [float(_check.number(v, _check.at(key, i), minimum=0)) for i, v in enumerate(value)]
        if abs(sum(probs) - 1.0) > 1e-6:
            raise ConfigError(f"{key}: must sum to 1 (as NeMo requires), got {value!r} (sum {sum(probs):g})")
        for i, has_weight in enumerate(explicit_weight):
            if has_weight:
                raise ConfigError(f"sources[{i}].weight: conflicts with {key}, which sets every source's weight")
        out["weights"] = probs
    return out


def nemo_options(
    m: Mapping[str, Any], nemo: dict[str, tuple[str, Any]], *, default_shuffle_buffer: int
) -> dict[str, Any]:
    """The Mixture options NeMo's ``seed`` and ``shuffle`` imply (checked against ``shuffle_buffer``)."""
    options: dict[str, Any] = {}
    if "seed" in nemo:
        key, value = nemo["seed"]
        options["seed"] = int(_check.number(value, key, minimum=0, integer=True))
    if "shuffle" in nemo:
        key, value = nemo["shuffle"]
        shuffle_buffer = _check.entry(
            m, "shuffle_buffer", default_shuffle_buffer, lambda v, p: _check.number(v, p, minimum=0, integer=True), ""
        )
        if not _check.boolean(value, key):
            if "shuffle_buffer" not in m:
                options["shuffle_buffer"] = 0
            elif shuffle_buffer > 1:
                raise ConfigError(f"shuffle_buffer: conflicts with {key}: false, got {shuffle_buffer!r}")
        elif "shuffle_buffer" in m and shuffle_buffer <= 1:
            raise ConfigError(f"shuffle_buffer: {shuffle_buffer!r} does not shuffle, but {key} is true")
    return options
