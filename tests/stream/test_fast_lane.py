"""The reader's fast lane (`SourceStream._read_into` + `mixer._native._tarwalk.samples`): runs of samples in
the default format become `Sample`s in one C call; every other sample goes through `make_sample`.
The lane must change nothing a user can see: the same batches, counters and states as the
per-sample path (``mixer.stream.source_stream._convert = None``), on mixed formats, the length policy, shared
shards, damage, and the sample path's own oracle, Python's decode."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shardutil import expected_tokens, write_samples

import mixer
import mixer.plan.world
import mixer.stream.source_stream
from mixer.plan.world import Draws

pytestmark = pytest.mark.skipif(mixer.stream.source_stream._convert is None, reason="the compiled core was not built")


def _mixed_source(folder: Path, shards: int = 3, per_shard: int = 90) -> str:
    """Samples the lane takes (int32 tokens.npy, int64 input_ids.npy, an extra json member) and
    samples it must leave to make_sample (big-endian tokens, txt only, too long for the budget)."""
    rng = np.random.default_rng(7)
    out = []
    for s in range(shards):
        samples: list[dict[str, Any]] = []
        for i in range(per_shard):
            key = f"m-{s}-{i:04d}"
            n = int(rng.integers(1, 400))
            kind = i % 9
            if kind == 5:
                samples.append({"__key__": key, "txt": "x" * n})
            elif kind == 6:
                samples.append({"__key__": key, "tokens.npy": expected_tokens(key, n).astype(">i4")})
            elif kind == 7:
                samples.append({"__key__": key, "tokens.npy": expected_tokens(key, 700 + n)})  # over max_length
            elif kind == 8:
                samples.append(
                    {"__key__": key, "input_ids.npy": expected_tokens(key, n, dtype=np.int64), "json": b'{"a": 1}'}
                )
            else:
                samples.append({"__key__": key, "tokens.npy": expected_tokens(key, n)})
        out.append(samples)
    return write_samples(folder, "m", out)


def _run(
    pattern: str, lane: bool, monkeypatch: pytest.MonkeyPatch, *, batches: int = 40, workers: int = 0, **options: Any
) -> tuple[list[Any], Any, Any]:
    """Batches (keys, lengths, tokens), stats counters and the loader state after `batches` batches."""
    with monkeypatch.context() as m:
        if not lane:
            m.setattr(mixer.stream.source_stream, "_convert", None)
        source_options = options.pop("source", {})
        sources = [
            mixer.Source("m", pattern, **source_options),
            mixer.Source("n", pattern, weight=0.5, **source_options),
        ]
        mix = mixer.Mixture(
            sources,
            batching=mixer.TokenBudget(4096, max_length=512),
            seed=3,
            shuffle_buffer=64,
            state_every=4,
            **options,
        )
        loader = mixer.make_loader(mix, num_workers=workers)
        seen = []
        for i, batch in enumerate(loader):
            seen.append((list(batch.keys), batch.lengths.tolist(), batch.tokens.numpy().copy()))
            if i + 1 == batches:
                break
        state = loader.state_dict()
        return seen, loader.counters(), state


def _same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b) > 0
    for (ka, la, ta), (kb, lb, tb) in zip(a, b):
        assert ka == kb and la == lb
        assert np.array_equal(ta, tb)


@pytest.mark.parametrize("mix", ["batch", "sample"])
def test_the_lane_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mix: str) -> None:
    pattern = _mixed_source(tmp_path)
    fast, fast_counters, fast_state = _run(pattern, True, monkeypatch, mix=mix)
    slow, slow_counters, slow_state = _run(pattern, False, monkeypatch, mix=mix)
    _same(fast, slow)
    assert fast_counters == slow_counters
    assert fast_state == slow_state
    # the policy was exercised: some samples were truncated, some came from txt
    lengths = [n for _, ls, _ in fast for n in ls]
    assert max(lengths) == 512 and min(lengths) >= 1


def test_the_lane_and_python_decode_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the pure-Python sample path (no C decode at all): the oracle of the compiled one."""
    pattern = _mixed_source(tmp_path)
    fast, _, fast_state = _run(pattern, True, monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(mixer.read.decode, "NATIVE", False)
        m.setattr(mixer.read.tario, "NATIVE", False)
        oracle, _, oracle_state = _run(pattern, True, monkeypatch)
    _same(fast, oracle)
    assert fast_state == oracle_state


def test_shared_shards_and_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One shard read by two workers (every other sample each: the lane steps aside) and a resume."""
    pattern = _mixed_source(tmp_path, shards=1, per_shard=200)
    fast, _, state = _run(pattern, True, monkeypatch, workers=2, batches=24)
    slow, _, slow_state = _run(pattern, False, monkeypatch, workers=2, batches=24)
    _same(fast, slow)
    assert state == slow_state
    # the shard is split by sample index over the two readers: both parities delivered, both readers read
    parities = {int(k.rsplit("-", 1)[1]) % 2 for ks, _, _ in fast for k in ks}
    assert parities == {0, 1}
    # resume from the lane's state: the next batches are those of an uninterrupted run
    whole, _, _ = _run(pattern, True, monkeypatch, workers=2, batches=36)
    sources = [mixer.Source("m", pattern), mixer.Source("n", pattern, weight=0.5)]
    mix = mixer.Mixture(
        sources, batching=mixer.TokenBudget(4096, max_length=512), seed=3, shuffle_buffer=64, state_every=4
    )
    loader = mixer.make_loader(mix, num_workers=2)
    loader.load_state_dict(state)
    rest = []
    for i, batch in enumerate(loader):
        rest.append((list(batch.keys), batch.lengths.tolist(), batch.tokens.numpy().copy()))
        if i + 1 == 12:
            break
    _same(rest, whole[24:])


@pytest.mark.filterwarnings("ignore:source .* skipping the rest of shard")
def test_damage_is_counted_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pattern = _mixed_source(tmp_path, shards=2, per_shard=120)
    victim = tmp_path / "m-000001.tar"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # cut mid-shard
    runs = [
        _run(pattern, lane, monkeypatch, batches=60, stop="all_exhausted", source={"on_error": "skip"})
        for lane in (True, False)
    ]
    (fast, fast_counters, _), (slow, slow_counters, _) = runs
    _same(fast, slow)
    assert fast_counters == slow_counters


def test_samples_from_the_lane_are_untracked(tmp_path: Path) -> None:
    """A Sample holds a str, an array and ints: the collector need not walk it (CPython untracks a
    plain tuple like it, never a tuple subclass). Held in buffers, tracked ones would bring full
    collections of the whole heap."""
    keys = [f"u-{i:03d}" for i in range(30)]
    pattern = write_samples(
        tmp_path, "u", [[{"__key__": k, "tokens.npy": expected_tokens(k, 10 + i)} for i, k in enumerate(keys)]]
    )
    mix = mixer.Mixture(
        [mixer.Source("u", pattern)], batching=mixer.TokenBudget(4096), seed=0, shuffle_buffer=8, stop="all_exhausted"
    )
    got = list(mix.reader(mixer.plan.world.World()).streams[0])
    assert sorted(s.key for s in got) == keys
    for s in got:
        assert not gc.is_tracked(s)
        assert s.length == len(s.tokens) and np.array_equal(s.tokens, expected_tokens(s.key, s.length))


def test_samples_checks_its_arguments() -> None:
    from mixer._native import _tarwalk
    from mixer.read.decode import Sample

    with pytest.raises(TypeError):
        _tarwalk.samples((), 0, 0, 0, 10, Sample, [])
    with pytest.raises(TypeError):
        _tarwalk.samples([], 0, 0, 0, 10, dict, [])
    with pytest.raises(ValueError):
        _tarwalk.samples([], 0, 1, 0, 10, Sample, [])
    assert _tarwalk.samples([], 0, 0, 0, 10, Sample, []) == (0, None)


@pytest.mark.parametrize("native", [True, False])
def test_take_is_the_shuffle_pop(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Draws.take(items) is a draw of `random` and a swap-remove at int(u * len): the same items
    in the same order, across block refills, as the two written out (in C and in Python)."""
    monkeypatch.setattr(mixer.plan.world, "NATIVE", native)
    a, b = Draws(1, "shuffle", "x", 0), Draws(1, "shuffle", "x", 0)
    items_a, items_b = list(range(1000)), list(range(1000))
    for _ in range(999):
        j = int(b.random() * len(items_b))
        expected = items_b[j]
        items_b[j] = items_b[-1]
        items_b.pop()
        assert a.take(items_a) == expected
        assert items_a == items_b
    assert a.taken == b.taken == 999

    with pytest.raises(IndexError):
        a.take([])


def test_txt_tokens_in_c_are_pythons() -> None:
    """A sample with only a txt member: its UTF-8 bytes as uint8, the same array both ways."""
    from mixer.read.decode import default_tokens

    for text in (b"", b"plain", "caf\u00e9 \u2603".encode()):
        fast, slow = default_tokens({"txt": text}), default_tokens({"txt": text}, native=False)
        assert fast.dtype == slow.dtype == np.uint8 and np.array_equal(fast, slow)
    assert np.array_equal(
        default_tokens({"txt": "caf\u00e9"}), np.frombuffer("caf\u00e9".encode(), np.uint8)
    )  # a str: Python's
