"""Shard indexes (mixer.plan.index): build, incremental refresh, stale detection, remote (HTTP and S3 on
loopback), and what a mixture does with one: nothing read up front, sample ranges read by byte range
only, every sample exactly once over all readers, exact loss counts."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections import Counter

import numpy as np
import pytest
from servers import FaultyHTTPServer, make_bucket, remote_guard, s3_server, s3_storage_options  # noqa: F401 (remote_guard: a module-wide autouse fixture)
from shardutil import LogNormal, expected_tokens, write_sources, write_token_shards

import mixer
from mixer.errors import ShardError
from mixer.plan.shards import plan, range_bounds, shard_order
from mixer.plan.world import World
from mixer.read.tario import read_samples

SPEC = {
    "few": LogNormal(
        shards=2, samples=60, median=40, sigma=0.6, lo=2, hi=400, seed=1
    ),  # fewer shards than most worlds' readers
    "many": LogNormal(shards=5, samples=150, median=40, sigma=0.6, lo=2, hi=400, seed=2),
}


@pytest.fixture()
def sources(tmp_path):
    """A private copy per test: building an index writes next to the shards."""
    return write_sources(tmp_path / "shards", SPEC)


def samples_of(path):
    with open(path, "rb") as f:
        return [(raw["__key__"], raw["__offset__"], raw["__end__"]) for raw in read_samples(f, url=str(path))]


def collect(loader):
    out = []
    for batch in loader:
        for row, (key, n) in enumerate(zip(batch.keys, batch.lengths.tolist())):
            out.append((key, batch.tokens[row, :n].numpy().copy()))
    return out


# ---- building -----------------------------------------------------------------------------------


def test_build_records_every_sample_compactly(sources):
    pattern, lengths = sources["many"]
    idx = mixer.build_index(pattern)
    folder = os.path.dirname(pattern)
    assert idx.locations == (os.path.join(folder, "mixer-index.json.gz"),)
    assert len(idx.reindexed) == 5 and list(idx.shards) == sorted(idx.shards)
    for i, url in enumerate(idx.shards):
        truth = samples_of(url)  # what the tar reader finds, sample by sample
        assert idx.counts[i] == len(truth) == 30
        offsets = idx.offsets(i)
        assert offsets[:-1].tolist() == [o for _, o, _ in truth] and offsets[-1] == truth[-1][2]
        assert idx.lengths(i).tolist() == [lengths[k] for k, _, _ in truth]  # the default decode's token counts
        assert idx.entries[i].size == os.path.getsize(url)
        assert idx.entries[i].validator == f"mtime:{os.stat(url).st_mtime_ns}"
    assert int(idx.tokens.sum()) == sum(lengths.values())
    # compact: arrays, not an object per sample (150 samples, about 3 bytes each plus ~200 per shard)
    size = os.path.getsize(idx.locations[0])
    assert size < 2500, size
    doc = json.loads(gzip.decompress(open(idx.locations[0], "rb").read()))
    assert sorted(doc["shards"]) == [os.path.basename(u) for u in idx.shards]  # keyed by file name: the folder may move


def test_incremental_build_reads_only_new_and_changed_shards(sources, tmp_path):
    pattern, _ = sources["many"]
    folder = os.path.dirname(pattern)
    glob = os.path.join(folder, "many-*.tar")  # a glob: new shards join the listing
    first = mixer.build_index(glob)
    again = mixer.build_index(glob)
    assert again.reindexed == () and again.entries == first.entries
    # shard 1 rewritten with other samples, and a new shard added
    other = write_token_shards(tmp_path / "other", "many", [[7, 8, 9], [5] * 40])
    shutil.copy(other.replace("{000000..000001}", "000001"), os.path.join(folder, "many-000001.tar"))
    shutil.copy(other.replace("{000000..000001}", "000000"), os.path.join(folder, "many-000005.tar"))
    third = mixer.build_index(glob)
    assert sorted(os.path.basename(u) for u in third.reindexed) == ["many-000001.tar", "many-000005.tar"]
    assert third.counts.tolist() == [30, 40, 30, 30, 30, 3]
    assert [third.entries[i] for i in (0, 2, 3, 4)] == [first.entries[i] for i in (0, 2, 3, 4)]


def test_stale_entries_are_named_then_reindexed_or_refused(sources, caplog):
    pattern, _ = sources["few"]
    mixer.build_index(pattern)
    changed = pattern.replace("{000000..000001}", "000001")
    os.utime(changed, ns=(1, 1))  # same bytes, new modification time: the validator differs
    with pytest.raises(
        ShardError,
        match=r"stale for 1 shard\(s\): .*few-000001.tar \(indexed: \d+ bytes, mtime:\d+; now: \d+ bytes, "
        r"mtime:1\).*stale='refuse'",
    ):
        mixer.load_index(pattern, stale="refuse")
    with caplog.at_level("WARNING", logger="mixer.plan.index"):
        idx = mixer.load_index(pattern)  # auto: the folder is writable, so re-index
    assert [os.path.basename(u) for u in idx.reindexed] == ["few-000001.tar"]
    assert any("few-000001.tar" in r.getMessage() and "re-indexing" in r.getMessage() for r in caplog.records)
    assert mixer.load_index(pattern, stale="refuse").reindexed == ()  # written back
    with pytest.raises(ShardError, match="stale for 2 shard"):
        mixer.load_index(
            pattern, location=str(os.path.dirname(pattern)) + "/elsewhere.json", stale="refuse"
        )  # no file: no entries


def test_another_decode_makes_every_entry_stale(sources):
    pattern, _ = sources["few"]
    mixer.build_index(pattern)
    src = mixer.Source("few", pattern, length=lambda raw: 1)
    idx = mixer.load_index(src)
    assert len(idx.reindexed) == 2 and idx.tokens.tolist() == idx.counts.tolist()


# ---- using it -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size,num_workers", [(2, 2), (3, 1), (1, 0), (4, 3)])
def test_every_sample_exactly_once_with_an_index(sources, world_size, num_workers):
    # The union over all ranks and workers of one pass is every sample once, with its tokens; 'few'
    # has 2 shards for up to 12 readers, which then read sample ranges of them.
    seen = Counter()
    for rank in range(world_size):
        srcs = [mixer.Source(name, pattern, index=True) for name, (pattern, _) in sources.items()]
        mix = mixer.Mixture(
            srcs,
            batching=mixer.TokenBudget(max_tokens=1024),
            stop="all_exhausted",
            seed=5,
            rank=rank,
            world_size=world_size,
            shuffle_buffer=8,
        )
        assert [p.origin for p in mix.profiles] == ["index", "index"]
        for key, tokens in collect(mixer.make_loader(mix, num_workers=num_workers)):
            name = key.split("-")[0]
            np.testing.assert_array_equal(tokens, expected_tokens(key, sources[name][1][key]))
            seen[key] += 1
    assert set(seen) == {k for _, kl in sources.values() for k in kl}
    assert max(seen.values()) == 1


def test_ranges_balance_tokens_and_partition_every_epoch(sources):
    pattern, lengths = sources["few"]
    idx = mixer.load_index(pattern)
    total = sum(lengths.values())
    for readers in (1, 3, 7, 12):
        for epoch in (0, 1):
            order = np.asarray(shard_order(2, seed=3, source="few", epoch=epoch))
            got, loads = [], []
            for r in range(readers):
                slices = plan(2, World(rank=r, world_size=readers), seed=3, source="few", epoch=epoch, index=idx)
                mine = [(sl.shard, i) for sl in slices for i in range(sl.start, sl.stop)]
                got += mine
                loads.append(sum(int(idx.lengths(s)[i]) for s, i in mine))
                for sl in slices:
                    if sl.end is not None:  # the byte range is exactly the samples'
                        assert (sl.begin, sl.end) == (idx.offsets(sl.shard)[sl.start], idx.offsets(sl.shard)[sl.stop])
            assert sorted(got) == [(s, i) for s in range(2) for i in range(30)]
            assert sum(loads) == total
            # each reader within one sample (<= 400 tokens) of an equal share
            assert max(loads) - total / readers <= 400 and min(loads) >= total / readers - 400
            bounds = range_bounds(order, idx, readers, list(range(readers + 1)))
            assert bounds == sorted(bounds)  # monotone: the readers' runs follow each other


def test_a_mixture_with_an_index_reads_no_shard_up_front_and_ranges_read_only_their_bytes(tmp_path):
    # One shard over 4 readers: without an index every reader reads all of it (4x its bytes);
    # with one, the readers' ranged GETs add up to the shard once, and nothing is read up front.
    folder = tmp_path / "one"
    lengths = [int(x) for x in np.random.default_rng(0).integers(20, 200, 120)]
    write_token_shards(folder, "solo", [lengths])
    mixer.build_index(str(folder / "solo-000000.tar"))
    size = os.path.getsize(folder / "solo-000000.tar")
    with FaultyHTTPServer(tmp_path) as server:
        url = server.url("one/solo-000000.tar")

        def run(index):
            server.clear()
            keys = []
            for rank in range(4):
                mix = mixer.Mixture(
                    [mixer.Source("solo", url, index=index)],
                    batching=mixer.TokenBudget(max_tokens=1024),
                    stop="all_exhausted",
                    rank=rank,
                    world_size=4,
                )
                if rank == 0 and index:  # the index file is read, no shard
                    assert server.requests("one/solo-000000.tar") == [] and server.requests("one/mixer-index.json.gz")
                keys += [k for k, _ in collect(mixer.make_loader(mix, num_workers=0))]
            gets = server.requests("one/solo-000000.tar")
            return keys, gets

        keys, gets = run(True)
        assert sorted(keys) == sorted(f"solo-000000-{i:06d}" for i in range(120))
        assert len(gets) == 4 and all(g.end is not None for g in gets)
        spans = sorted((g.start or 0, g.end + 1) for g in gets)
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # back to back, no overlap
        assert sum(b - a for a, b in spans) <= size
        plain_keys, plain = run(None)
        assert sorted(plain_keys) == sorted(keys) and len(plain) >= 4 + 1  # profiling read it too
        assert sum((g.end + 1 if g.end is not None else size) - (g.start or 0) for g in plain) >= 4 * (size - 1024)


def test_remote_build_and_load_over_http(tmp_path):
    pattern, _ = write_sources(tmp_path / "web", {"web": SPEC["many"]})["web"]
    with FaultyHTTPServer(tmp_path) as server:
        remote = server.url("web/" + os.path.basename(pattern))
        location = str(tmp_path / "web-index.json")  # a server is read-only: the index is written locally
        first = mixer.build_index(remote, location=location)
        assert len(first.reindexed) == 5 and all(e.validator.startswith("etag:") for e in first.entries)
        server.clear()
        # served over HTTP too: loaded from its URL, verified by HEAD requests, no shard read
        idx = mixer.load_index(remote, location=server.url("web-index.json"))
        assert idx.reindexed == () and idx.entries == first.entries
        assert {r.path for r in server.requests(method="GET")} == {"web-index.json"}
        # one shard changes on the server: only it is read again (counted by the server)
        server.replace("web/web-000003.tar", open(tmp_path / "web" / "web-000001.tar", "rb").read())
        with pytest.raises(ShardError, match=r"web-000003.tar \(indexed: .*cannot be written"):
            mixer.load_index(remote, location=server.url("web-index.json"))  # auto, read-only location: refused
        before = len(server.requests(method="GET"))  # (clear() would also undo the replacement)
        third = mixer.build_index(remote, location=location)
        assert [u.rsplit("/", 1)[1] for u in third.reindexed] == ["web-000003.tar"]
        assert {r.path for r in server.requests(method="GET")[before:]} == {"web/web-000003.tar"}


def test_remote_build_load_and_read_over_s3(tmp_path):
    written = write_sources(tmp_path, {"s3src": SPEC["few"]})
    pattern, lengths = written["s3src"]
    files = {f"data/{name}": tmp_path / name for name in sorted(os.listdir(tmp_path)) if name.endswith(".tar")}
    with s3_server() as endpoint:
        make_bucket(endpoint, "bkt", files)
        opts = s3_storage_options(endpoint)
        src = mixer.Source("s3src", "s3://bkt/data/", storage_options=opts, index=True)
        built = mixer.build_index(src)  # next to the shards, in the bucket
        assert built.locations == ("s3://bkt/data/mixer-index.json.gz",) and len(built.reindexed) == 2
        assert mixer.load_index(src, stale="refuse").reindexed == ()
        seen = Counter()
        for rank in range(3):
            mix = mixer.Mixture(
                [src], batching=mixer.TokenBudget(max_tokens=1024), stop="all_exhausted", rank=rank, world_size=3
            )
            assert mix.profiles[0].origin == "index" and mix.sizes["s3src"] == sum(lengths.values())
            seen.update(k for k, _ in collect(mixer.make_loader(mix, num_workers=0)))
        assert seen == Counter({k: 1 for k in lengths})  # every sample once over the 3 ranks


def test_a_lost_range_is_counted_exactly(tmp_path):
    # With an index, a shard that cannot be read loses exactly its indexed samples (no "unknown").
    pattern, lengths = write_sources(tmp_path / "d", {"d": SPEC["few"]})["d"]
    with FaultyHTTPServer(tmp_path) as server:
        remote = server.url("d/" + os.path.basename(pattern))
        mixer.build_index(remote, location=str(tmp_path / "d.json"))
        server.fail("d/d-000001.tar", "status", status=404, times=None)  # GETs only; HEADs still answer
        mix = mixer.Mixture(
            [mixer.Source("d", remote, index=server.url("d.json"), on_error="skip")],
            batching=mixer.TokenBudget(max_tokens=1024),
            stop="all_exhausted",
            rank=0,
            world_size=1,
        )
        loader = mixer.make_loader(mix, num_workers=0)
        with pytest.warns(RuntimeWarning, match=r"30 indexed sample\(s\) of the range lost"):
            keys = [k for k, _ in collect(loader)]
        total = loader.stats()["sources"]["d"]["total"]
    assert sorted(keys) == sorted(k for k in lengths if k.startswith("d-000000"))
    assert (total["skipped_samples"], total["skipped_shards"], total["skipped_unknown"]) == (30, 1, 0)


def test_the_index_command_builds_then_refreshes(sources, tmp_path, capsys):
    from mixer.cli.commands import main

    pattern, lengths = sources["few"]
    config = tmp_path / "mix.yaml"
    config.write_text(
        f"sources:\n  - name: few\n    urls: '{pattern}'\n    index: true\nbatching:\n  max_tokens: 1024\n"
    )
    assert main(["index", "--quiet", pattern]) == 0
    out = capsys.readouterr().out
    assert f"2 shards, 60 samples, {sum(lengths.values()):,} tokens; 2 shard(s) read, 0 up to date" in out
    assert mixer.parse_config(str(config)).to_dict()["sources"][0]["index"] is True  # a config key, kept both ways
    assert main(["index", "--quiet", str(config)]) == 0  # a config's sources: the same decode, nothing to read
    assert "few: 2 shards, 60 samples" in (out := capsys.readouterr().out) and "0 shard(s) read, 2 up to date" in out


def test_a_mixture_with_an_index_resumes_exactly(tmp_path):
    # Readers inside sample ranges (3 ranks, 'tiny' of 2 shards split in ranges) resume at the byte
    # they stopped at, and the buffered samples come back from their locations: the shared oracle.
    from resume_oracle import assert_resumes_exactly, batch_view
    from shardutil import RESUME_SOURCES, mixture

    written = write_sources(tmp_path, RESUME_SOURCES)
    for name in written:
        mixer.build_index(written[name][0])
    mix = mixture(
        written,
        weights={"web": 0.5, "code": 0.3, "tiny": 0.2},
        source_options={"index": True},
        batching=mixer.TokenBudget(max_tokens=2048),
        state_every=8,
        shuffle_buffer=16,
        rank=1,
        world_size=3,
    )
    assert all(ls.index is not None for ls in mix.listed)
    assert_resumes_exactly(
        lambda: mixer.make_loader(mix, num_workers=0), cuts=[1, 5, 9, 17, 30], window=8, view=batch_view
    )


def test_a_damaged_shard_is_indexed_up_to_the_damage_under_skip(tmp_path, caplog):
    pattern, lengths = write_sources(tmp_path, {"d": SPEC["few"]})["d"]
    cut = pattern.replace("{000000..000001}", "000001")
    keep = samples_of(cut)[10][1]  # the first 10 samples whole, then 700 bytes of the 11th
    with open(cut, "r+b") as f:
        f.truncate(keep + 700)
    with pytest.raises(ShardError, match=r"indexing shard .*d-000001.tar.*truncated"):
        mixer.build_index(pattern)  # on_error="raise": the damage is an error, naming the shard
    src = mixer.Source("d", pattern, on_error="skip", index=True)
    with caplog.at_level("WARNING", logger="mixer.plan.index"):
        idx = mixer.build_index(src)
    assert idx.counts.tolist() == [30, 10] and idx.entries[1].damage is not None
    assert any(
        "d-000001.tar is damaged" in r.getMessage() and "10 sample(s) before the damage" in r.getMessage()
        for r in caplog.records
    )
    seen = Counter()
    for rank in range(2):  # readers read the good ranges only, and never meet the damage
        mix = mixer.Mixture(
            [src], batching=mixer.TokenBudget(max_tokens=1024), stop="all_exhausted", rank=rank, world_size=2
        )
        loader = mixer.make_loader(mix, num_workers=0)
        seen.update(k for k, _ in collect(loader))
        assert loader.stats()["sources"]["d"]["total"]["skipped_shards"] == 0
    assert sorted(seen) == sorted(
        k for k in lengths if k.startswith("d-000000") or int(k[-6:]) < 10 and k.startswith("d-000001")
    )
    assert max(seen.values()) == 1


# ---- the columnar twin: what a process loads --------------------------------------------------


def test_a_loaded_index_is_its_twin_mapped_not_the_json_parsed(sources, monkeypatch):
    """The first load writes the twin beside the index file; later loads map it and parse no JSON
    (the parser is made to fail), with the same entries; nothing per shard is copied (the shards
    are the twin's rows in order)."""
    from mixer.plan import index as index_module

    pattern, _ = sources["many"]
    built = mixer.build_index(pattern)
    twin = built.locations[0] + ".columns"
    assert os.path.exists(twin) and built.parts[0].path == twin and built.where is None

    def no_json(*args, **kwargs):
        raise AssertionError("the index file was parsed although its twin holds it")

    monkeypatch.setattr(index_module, "decode_columns", no_json)
    loaded = mixer.load_index(pattern)
    assert loaded.entries == built.entries and loaded.counts.tolist() == [30] * 5
    assert isinstance(loaded.counts, np.ndarray) and not loaded.counts.flags.writeable  # a view of the mapping
    for shard in range(5):
        assert np.array_equal(loaded.offsets(shard), built.entries[shard].offsets())
        assert np.array_equal(loaded.lengths(shard), built.entries[shard].lengths())


def test_a_twin_of_another_version_or_broken_is_written_again(sources, caplog):
    """The twin mirrors one version of the index file: rewritten (by a stale shard re-indexed), the
    file gets a new twin; a damaged twin is ignored and replaced; the JSON stays the one written."""
    pattern, _ = sources["few"]
    first = mixer.build_index(pattern)
    twin = first.locations[0] + ".columns"
    changed = pattern.replace("{000000..000001}", "000001")
    os.utime(changed, ns=(1, 1))
    with caplog.at_level("WARNING", logger="mixer.plan.index"):
        again = mixer.load_index(pattern)  # re-indexes the shard and rewrites the file
    assert [os.path.basename(u) for u in again.reindexed] == ["few-000001.tar"]
    assert again.parts[0].path == twin and again.entries[1].validator == "mtime:1"
    assert mixer.load_index(pattern, stale="refuse").entries == again.entries
    with open(twin, "r+b") as f:
        f.write(b"garbage!")
    assert mixer.load_index(pattern, stale="refuse").entries == again.entries
    with open(twin, "rb") as f:
        assert f.read(8) == b"MIXERCOL"  # written again
    doc = json.loads(gzip.decompress(open(first.locations[0], "rb").read()))
    assert doc["version"] == 1 and sorted(doc["shards"]) == ["few-000000.tar", "few-000001.tar"]


def test_an_index_whose_folder_takes_no_twin_is_twinned_in_the_machine_cache(sources, tmp_path, monkeypatch):
    """Where the twin cannot be written beside the index file (a read-only dataset folder; here the
    name is taken by a folder, which fails the same way for any user), it goes to this machine's
    temporary directory, named for the index file and its version, and older versions' twins of
    the same file there are removed."""
    import tempfile

    pattern, _ = sources["few"]
    built = mixer.build_index(pattern)
    beside = built.locations[0] + ".columns"
    os.unlink(beside)
    os.mkdir(beside)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "machine-tmp"))
    cache = tmp_path / "machine-tmp" / "mixer-index-columns"
    loaded = mixer.load_index(pattern, stale="refuse")
    first = loaded.parts[0].path
    assert first.startswith(str(cache)) and first.endswith(".columns") and loaded.entries == built.entries
    os.utime(pattern.replace("{000000..000001}", "000000"), ns=(1, 1))
    again = mixer.load_index(pattern)  # re-indexed: a new version of the index file, a new twin
    assert again.parts[0].path != first and sorted(os.listdir(cache)) == [os.path.basename(again.parts[0].path)]


def test_a_twin_travels_to_a_spawned_worker_as_its_path(sources):
    """Pickled (a spawned DataLoader worker's copy of the mixture), a mapped index is its twin's
    path, mapped again on arrival; one held in memory travels as its arrays."""
    import pickle

    from mixer.plan.shard_index import entries_columns

    pattern, _ = sources["many"]
    idx = mixer.load_index(pattern)
    data = pickle.dumps(idx)
    assert len(data) < 2000  # the path and a few fields, not the columns
    back = pickle.loads(data)
    assert back.parts[0].path == idx.parts[0].path and back.entries == idx.entries
    held = entries_columns({f"s{i}": e for i, e in enumerate(idx.entries)}, idx.tokens_by, None)
    again = pickle.loads(pickle.dumps(held))
    assert again.path is None and np.array_equal(again.samples, held.samples)
    assert [again.offsets(r).tolist() for r in range(5)] == [e.offsets().tolist() for e in idx.entries]


@pytest.mark.slow
def test_every_sample_exactly_once_with_an_index_in_spawned_workers(sources):
    """The same pass as above through spawned workers (each maps the twin itself)."""
    pattern, lengths = sources["many"]
    mixer.build_index(pattern)
    src = mixer.Source("many", pattern, index=True)
    mix = mixer.Mixture([src], batching=mixer.TokenBudget(max_tokens=1024), stop="all_exhausted")
    got = collect(mixer.make_loader(mix, num_workers=2, multiprocessing_context="spawn"))
    assert sorted(k for k, _ in got) == sorted(lengths)
    for key, tokens in got:
        assert np.array_equal(tokens, expected_tokens(key, lengths[key]))
