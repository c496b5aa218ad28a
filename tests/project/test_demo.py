"""The demo shards (mixer.cli.demo) and the test suite's shard writer (tests/support/shardutil.py)."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from braceexpand import braceexpand
from shardutil import (
    expected_tokens,
    key_lengths,
    lognormal_lengths,
    npy_bytes,
    split_evenly,
    write_tar_members,
    write_token_shards,
)

from mixer.cli import demo
from mixer.cli.demo import ensure_demo_shards


def demo_root(patterns: dict[str, str]) -> Path:
    # <root>/v1/<source>/<source>-{..}.tar
    return Path(patterns["prose"]).parents[2]


def read_members(path: str | Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(path) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]


def read_demo_samples(pattern: str) -> list[tuple[str, str, bytes, np.ndarray]]:
    """(shard file, key, txt bytes, tokens) of every sample, in file order."""
    samples = []
    for path in braceexpand(pattern):
        members = read_members(path)
        assert len(members) % 2 == 0, path
        for (npy, tokens), (txt, text) in zip(members[0::2], members[1::2]):
            key = npy.name.removesuffix(".tokens.npy")
            assert txt.name == key + ".txt", (npy.name, txt.name)  # members of a sample adjacent
            samples.append((path, key, text, np.load(io.BytesIO(tokens))))
    return samples


def tree_snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


# --- demo ------------------------------------------------------------------------------------


def test_patterns_expand_to_existing_shards(demo_shards: dict[str, str]) -> None:
    assert list(demo_shards) == ["prose", "code", "books"]
    for name, shards in {"prose": 16, "code": 8, "books": 4}.items():
        paths = list(braceexpand(demo_shards[name]))
        assert len(paths) == shards
        assert all(os.path.isfile(p) and os.path.getsize(p) > 0 for p in paths)


def test_samples_hold_utf8_bytes_as_int32_tokens(demo_shards: dict[str, str]) -> None:
    keys = []
    for name, pattern in demo_shards.items():
        samples = read_demo_samples(pattern)
        assert len(samples) >= 4 * demo.SHARDS[name]
        for path, key, text, tokens in samples:
            text.decode("utf-8")  # valid UTF-8, else this raises
            assert tokens.dtype == np.int32 and tokens.ndim == 1
            np.testing.assert_array_equal(tokens, np.frombuffer(text, dtype=np.uint8))
            source, shard, _ = key.split("-")
            assert source == name and path.endswith(f"{name}-{shard}.tar")
            keys.append(key)
    assert len(set(keys)) == len(keys)  # unique across all sources


def test_members_have_integer_mtime_and_no_pax_headers(demo_shards: dict[str, str], tmp_path: Path) -> None:
    # The inspection below must be able to see a PAX header: webdataset's default float mtime makes one.
    with wds.TarWriter(str(tmp_path / "float.tar")) as writer:
        writer.write({"__key__": "a", "txt": "x"})
    assert read_members(tmp_path / "float.tar")[0][0].pax_headers

    for pattern in demo_shards.values():
        for path in braceexpand(pattern):
            with tarfile.open(path) as tar:
                members = tar.getmembers()
                assert tar.pax_headers == {}
            assert all(m.pax_headers == {} and m.isfile() for m in members)
            assert {m.mtime for m in members} == {demo.MTIME}
            # USTAR: 512-byte header + data padded to 512 per member, nothing else (no extra headers).
            blocks = sum(1 + (m.size + 511) // 512 for m in members)
            assert members[-1].offset_data + (members[-1].size + 511) // 512 * 512 == blocks * 512


def test_source_length_distributions_differ(demo_shards: dict[str, str]) -> None:
    lengths = {
        name: np.array([len(text) for _, _, text, _ in read_demo_samples(pattern)])
        for name, pattern in demo_shards.items()
    }
    medians = {name: float(np.median(x)) for name, x in lengths.items()}
    assert 2 * medians["prose"] < medians["code"], medians
    assert 8 * medians["code"] < medians["books"], medians
    assert demo.BOOK_MIN <= lengths["books"].min() and lengths["books"].max() <= demo.BOOK_MAX
    assert lengths["code"].max() <= demo.CODE_MAX and lengths["prose"].max() <= demo.PROSE_MAX
    # code is long-tailed: its longest samples are far above its median
    assert np.quantile(lengths["code"], 0.99) > 8 * medians["code"], medians


@pytest.mark.slow
def test_generation_is_deterministic(demo_shards: dict[str, str], tmp_path: Path) -> None:
    again = ensure_demo_shards(tmp_path)
    first, second = demo_root(demo_shards) / "v1", tmp_path / "v1"
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for rel in files:
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel
    root = str(demo_root(demo_shards))
    assert again == {name: pattern.replace(root, str(tmp_path)) for name, pattern in demo_shards.items()}


def test_reuse_does_not_rewrite(demo_shards: dict[str, str]) -> None:
    root = demo_root(demo_shards)
    before = tree_snapshot(root)
    assert ensure_demo_shards(root) == demo_shards
    assert tree_snapshot(root) == before


@pytest.fixture(scope="module")
def harvested() -> dict[str, list[str]]:
    return demo._harvest()


@pytest.fixture
def quick_harvest(monkeypatch: pytest.MonkeyPatch, harvested: dict[str, list[str]]) -> None:
    # Reading the stdlib is deterministic (test_generation_is_deterministic); these tests are
    # about the cache folder, so they reuse one harvest and only pay for writing.
    monkeypatch.setattr(demo, "_harvest", lambda: harvested)


@pytest.mark.slow
@pytest.mark.usefixtures("quick_harvest")
def test_leftovers_of_an_interrupted_run_do_not_break_a_later_run(demo_shards: dict[str, str], tmp_path: Path) -> None:
    # A run killed mid-write leaves its temp folder behind; one that is still going has a fresh one.
    dead = tmp_path / ".v1.tmp-dead"
    (dead / "prose").mkdir(parents=True)
    (dead / "prose" / "prose-0000.tar").write_bytes(b"\0" * 700)  # half a tar
    old = time.time() - 2 * demo.STALE_TMP_S
    os.utime(dead, (old, old))
    alive = tmp_path / ".v1.tmp-alive"
    alive.mkdir()
    # And a final folder that is not ours (no manifest) must not be taken for a finished dataset.
    (tmp_path / "v1" / "prose").mkdir(parents=True)
    (tmp_path / "v1" / "prose" / "prose-0000.tar").write_bytes(b"junk")

    patterns = ensure_demo_shards(tmp_path)

    assert not dead.exists() and alive.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".v1.tmp-alive", "v1"]
    for name, pattern in patterns.items():
        for mine, reference in zip(braceexpand(pattern), braceexpand(demo_shards[name]), strict=True):
            assert Path(mine).read_bytes() == Path(reference).read_bytes()


@pytest.mark.usefixtures("quick_harvest")
def test_an_interrupted_generation_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_source = demo._write_source

    def interrupted(folder: Path, name: str, texts: list[str], shards: int) -> dict:
        if name == "code":  # after prose is on disk
            raise KeyboardInterrupt
        return write_source(folder, name, texts, shards)

    monkeypatch.setattr(demo, "_write_source", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_demo_shards(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("quick_harvest")
def test_a_run_that_loses_the_race_reuses_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Force the interleaving: while this run writes into its temp folder, another run starts,
    # finishes and publishes. Ours must then find v1 taken, keep the winner's files, clean up.
    write_sources = demo._write_sources
    winner: dict[str, str] = {}
    calls = []

    def write_then_lose(folder: Path, texts: dict[str, list[str]]) -> dict:
        manifest = write_sources(folder, texts)
        calls.append(folder)
        if len(calls) == 1:  # the other run writes (calls == 2) and publishes before we do
            winner.update(ensure_demo_shards(tmp_path))
        return manifest

    monkeypatch.setattr(demo, "_write_sources", write_then_lose)
    first = ensure_demo_shards(tmp_path)
    published = tree_snapshot(tmp_path / "v1")

    assert len(calls) == 2 and calls[0] != calls[1] and first == winner
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # the loser's temp folder is gone
    assert ensure_demo_shards(tmp_path) == first and tree_snapshot(tmp_path / "v1") == published


# --- shardutil -------------------------------------------------------------------------------


def test_write_token_shards_round_trip(tmp_path: Path) -> None:
    per_shard = [[3, 1, 4], [], [1, 5, 9, 2]]  # an empty shard in the middle is allowed
    pattern = write_token_shards(tmp_path, "web", per_shard, seed=7)
    assert pattern == str(tmp_path / "web-{000000..000002}.tar")
    assert all(os.path.isfile(p) for p in braceexpand(pattern))

    dataset = wds.WebDataset(pattern, shardshuffle=False, empty_check=False).decode()
    got = {s["__key__"]: s["tokens.npy"] for s in dataset}
    assert list(got) == list(key_lengths("web", per_shard))  # file order, keys as documented
    assert list(got)[3] == "web-000002-000000"
    for key, length in key_lengths("web", per_shard).items():
        assert got[key].dtype == np.int32
        np.testing.assert_array_equal(got[key], expected_tokens(key, length, seed=7))
    for path in braceexpand(pattern):
        assert all(m.pax_headers == {} for m, _ in read_members(path))


def test_expected_tokens_range_and_dependence() -> None:
    tokens = expected_tokens("k", 20000)
    assert tokens.min() >= 1 and tokens.max() <= 30000  # 0 is the pad id
    assert len(np.unique(tokens)) > 10000
    np.testing.assert_array_equal(tokens, expected_tokens("k", 20000))
    assert not np.array_equal(tokens[:100], expected_tokens("j", 100))
    assert not np.array_equal(tokens[:100], expected_tokens("k", 100, seed=1))


def test_write_token_shards_other_member_and_dtype(tmp_path: Path) -> None:
    pattern = write_token_shards(tmp_path, "ids", [[6, 2]], dtype=np.int64, member="input_ids.npy")
    assert pattern == str(tmp_path / "ids-000000.tar")
    (info, data), _ = read_members(pattern)
    assert info.name == "ids-000000-000000.input_ids.npy"
    array = np.load(io.BytesIO(data))
    assert array.dtype == np.int64
    np.testing.assert_array_equal(array, expected_tokens("ids-000000-000000", 6))


def test_lognormal_lengths() -> None:
    # lo and hi sit 1.4 and 2.4 sigma from the median: about 8% and 1% of 4001 draws get clipped.
    lengths = lognormal_lengths(4001, median=300, sigma=0.8, lo=100, hi=2000, seed=3)
    assert lengths == lognormal_lengths(4001, median=300, sigma=0.8, lo=100, hi=2000, seed=3)
    assert all(isinstance(n, int) for n in lengths) and min(lengths) == 100 and max(lengths) == 2000
    assert 280 < np.median(lengths) < 320
    assert split_evenly(list(range(5)), 2) == [[0, 1], [2, 3, 4]]
    assert [len(s) for s in split_evenly(list(range(10)), 4)] == [2, 3, 2, 3]


def test_three_sources_fixture(three_sources: dict[str, tuple[str, dict[str, int]]]) -> None:
    medians = {name: np.median(list(lengths.values())) for name, (_, lengths) in three_sources.items()}
    assert medians["web"] < medians["code"] < medians["books"]
    pattern, lengths = three_sources["books"]
    assert len(list(braceexpand(pattern))) == 2
    got = {s["__key__"]: s["tokens.npy"] for s in wds.WebDataset(pattern, shardshuffle=False).decode()}
    assert {k: len(v) for k, v in got.items()} == lengths


def test_write_tar_members_keeps_names_and_order(tmp_path: Path) -> None:
    members = [("a.txt", b"hello"), ("noext", b""), ("a.tokens.npy", npy_bytes(np.arange(3)))]
    path = write_tar_members(tmp_path / "odd.tar", members)
    assert [(m.name, data) for m, data in read_members(path)] == members


def test_license_texts_are_optional(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A fresh machine may lack Debian's common-licenses: the stdlib alone must do.
    monkeypatch.setattr(demo, "_LICENSE_DIR", tmp_path / "absent")
    assert all(name == "LICENSE.txt" for name, _ in demo._licenses())
    (tmp_path / "licenses").mkdir()
    (tmp_path / "licenses" / "X").write_text("x")
    (tmp_path / "licenses" / "Y").symlink_to("X")  # a symlinked duplicate counts once
    monkeypatch.setattr(demo, "_LICENSE_DIR", tmp_path / "licenses")
    assert [name for name, _ in demo._licenses()][:1] == ["X"]
    assert "Y" not in [name for name, _ in demo._licenses()]


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo._default_cache_dir() == tmp_path / "mixer" / "demo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo._default_cache_dir() == tmp_path / "home" / ".cache" / "mixer" / "demo"
