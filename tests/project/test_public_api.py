"""The public API is exactly this list: one spelling per operation (like httpx's test_exported_members).

Adding, removing or renaming a public name is a deliberate change to this list, not a side effect.
"""

import re
import types

import pytest

import mixer

PUBLIC = [
    "Adaptive",
    "Batch",
    "BatchMeta",
    "ConfigError",
    "Curriculum",
    "Field",
    "FieldBatch",
    "Floored",
    "Hierarchical",
    "IOOptions",
    "Loader",
    "MixerError",
    "Mixture",
    "MixtureConfig",
    "Packed",
    "PackedBatch",
    "Phase",
    "SampleError",
    "Schedule",
    "ShardError",
    "Source",
    "SourceInfo",
    "SpeechDecode",
    "StateError",
    "Static",
    "Temperature",
    "TextDecode",
    "TokenBudget",
    "Weights",
    "build_index",
    "build_mixture",
    "load_config",
    "load_index",
    "log_every",
    "make_loader",
    "parse_config",
    "pretokenize",
    "to_device",
]


def test_all_is_exactly_the_public_list():
    assert mixer.__all__ == PUBLIC  # literally, sorted


def test_every_public_name_is_exported_and_every_export_resolves():
    # Submodules (mixer.storage, mixer.plan.world, ...) are reachable but not part of the flat API.
    public = {n for n in dir(mixer) if not n.startswith("_") and not isinstance(getattr(mixer, n), types.ModuleType)}
    assert public == set(mixer.__all__)
    for name in mixer.__all__:
        assert getattr(mixer, name).__module__.startswith("mixer.")


def test_one_way_to_build_a_loader(three_sources):
    # `Loader` is exported for annotations; make_loader is the constructor.
    mix = mixer.Mixture([mixer.Source("web", three_sources["web"][0])], batching=mixer.TokenBudget(max_tokens=2048))
    loader = mixer.make_loader(mix)
    assert isinstance(loader, mixer.Loader) and loader.state_dict()["delivered"] == 0
    with pytest.raises(TypeError, match=r"use mixer\.make_loader\(mixture, \.\.\.\)"):
        mixer.Loader(mix)
    with pytest.raises(TypeError, match="no_such_option"):
        mixer.make_loader(mix, no_such_option=1)
    # the options are spelled out (types and defaults for type checkers and IDEs), all keyword-only
    import inspect

    params = list(inspect.signature(mixer.make_loader).parameters.values())
    assert params[0].name == "mixture" and len(params) > 10
    assert all(
        p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty for p in params[1:]
    )


def test_removed_spellings_stay_removed():
    # Test-only helpers live in their modules (mixer.plan.world.World, mixer.plan.edges.bucket_edges); the
    # device feed is built by mixer.to_device (or make_loader(device=...)), never by its class.
    for name in ("World", "bucket_edges", "DeviceFeed"):
        assert not hasattr(mixer, name)


def test_user_facing_text_builds_loaders_and_device_feeds_one_way():
    # The README, the docs, the changelog, the examples and the docstrings show make_loader and
    # to_device, never the classes;
    # to_device itself is the one place that builds a DeviceFeed.
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    texts = [
        repo / "README.md",
        repo / "CHANGELOG.md",
        *sorted((repo / "docs").rglob("*.md")),
        *sorted((repo / "examples").iterdir()),
        *sorted((repo / "mixer").rglob("*.py")),
    ]
    direct = re.compile(r"(?<![\w.])(?<!class )(?:mixer\.)?(?:Loader|DeviceFeed)\(")
    found = [
        f"{path.relative_to(repo)}: {line.strip()}"
        for path in texts
        if path.is_file()
        for line in path.read_text(encoding="utf-8").splitlines()
        if direct.search(line)
    ]
    assert found == ["mixer/runtime/device.py: return DeviceFeed(batches, device, prefetch=prefetch, timing=timing)"]


def test_elastic_resume_is_load_state_dict_with_the_list_of_all_rank_states():
    # One spelling: a new rank passes every saved rank's state to load_state_dict, as a list or a
    # sequence that reads them when asked (mixer.mixing.elastic re-splits it); there is no merge
    # function to call first.
    import inspect

    annotation = str(inspect.signature(mixer.Loader.load_state_dict).parameters["state"].annotation)
    assert annotation == "dict[str, Any] | Sequence[dict[str, Any]]"
    assert not hasattr(mixer, "merge_states") and not hasattr(mixer, "elastic_resume")
