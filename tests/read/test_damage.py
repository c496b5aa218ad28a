"""What a damaged shard costs under ``on_error="skip"``: every complete sample before the damage is
delivered, and what is lost is counted (exactly in samples where the shard lets us know, otherwise
as a shard whose rest is unknown, in bytes), per source, in the counters, ``stats()`` and the report.

Expectations come from the intact shard's layout as `tarfile` lists it, never from running the reader.
"""

from __future__ import annotations

import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shardutil import expected_tokens, token_key, write_token_shards

import mixer
from mixer.observe.stats import format_table, report

N = 40  # samples in the damaged shard; one member (tokens.npy) each


def layout(path: Path) -> list[tuple[int, int]]:
    """(header offset, data offset) of each member of the intact shard."""
    with tarfile.open(path) as tar:
        return [(m.offset, m.offset_data) for m in tar.getmembers()]


@pytest.fixture
def shards(tmp_path: Path) -> tuple[str, list[Path]]:
    """Two shards of ``N`` samples each (lengths 5..60): ``d-000000.tar`` (intact) and ``d-000001.tar``
    (damaged by each test)."""
    rng = np.random.default_rng(3)
    pattern = write_token_shards(tmp_path, "d", [rng.integers(5, 60, N).tolist() for _ in range(2)])
    return pattern, [tmp_path / f"d-{i:06d}.tar" for i in range(2)]


def run(pattern: str, *, workers: int = 0, shuffle_buffer: int = 0) -> tuple[list[str], dict[str, int], Any, list[str]]:
    """One pass: the delivered keys (each checked against its tokens), the source's counters, the
    loader and the warnings raised in this process."""
    source = mixer.Source("d", pattern, on_error="skip")
    mix = mixer.Mixture(
        [source],
        batching=mixer.TokenBudget(max_tokens=512),
        stop="all_exhausted",
        shuffle_buffer=shuffle_buffer,
        seed=1,
    )
    loader = mixer.make_loader(mix, num_workers=workers)
    keys = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in loader:
            for row, key in enumerate(batch.keys):
                n = int(batch.lengths[row])
                assert np.array_equal(batch.tokens[row, :n].numpy(), expected_tokens(key, n)), key
                keys.append(key)
    assert len(keys) == len(set(keys))
    return keys, loader.counters()["d"], loader, [str(w.message) for w in caught]


def loss(counters: dict[str, int]) -> tuple[int, int, int, int]:
    return (
        counters["skipped_samples"],
        counters["skipped_shards"],
        counters["skipped_unknown"],
        counters["skipped_bytes"],
    )


def damaged_keys(first_lost: int) -> set[str]:
    return {token_key("d", 0, i) for i in range(N)} | {token_key("d", 1, i) for i in range(first_lost)}


def test_truncated_inside_member_30_delivers_29_and_counts_30(shards: tuple[str, list[Path]]) -> None:
    # The case: cut inside member 30's data. Sample 29's member was read whole and sample
    # 30's header was read (another key): 29 is complete and delivered. Sample 30 is lost, exactly
    # one sample, and the file ends there: no unknown rest; the bytes from 30's header to the cut.
    pattern, (_, bad) = shards
    members = layout(bad)
    cut = members[30][1] + 100
    bad.write_bytes(bad.read_bytes()[:cut])
    keys, counters, loader, caught = run(pattern)
    assert set(keys) == damaged_keys(30)
    assert loss(counters) == (1, 1, 0, cut - members[30][0])
    assert counters["samples"] == 2 * N - 10 and counters["shards_finished"] == 1
    [warning] = [w for w in caught if "skipping" in w]
    assert f"1 sample(s) cut by the damage; the shard ends there, {cut - members[30][0]} bytes undelivered" in warning
    assert "d-000001.tar" in warning and f"truncated at byte {cut}" in warning

    # ... and the same numbers per source in stats(), the report and its table
    stats = loader.stats()["sources"]["d"]["total"]
    assert loss(stats) == (1, 1, 0, cut - members[30][0])
    rep = report(loader.stats())["sources"]["d"]
    assert (rep["skipped_samples"], rep["skipped_shards"], rep["skipped_unknown"], rep["skipped_bytes"]) == loss(
        counters
    )
    row = format_table(report(loader.stats())).splitlines()[2].split()
    assert row[0] == "d" and row[-4:] == ["1", "1", "0", f"{cut - members[30][0]:,}"]


def test_ending_at_a_member_boundary_is_an_archive_without_end_blocks(shards: tuple[str, list[Path]]) -> None:
    # Bytes that stop exactly where member 30 would start: an archive whose writer left out the
    # end-of-archive blocks (streaming writers do). Read as tarfile and webdataset read it: sample 29
    # is whole and delivered, nothing is lost or counted.
    pattern, (_, bad) = shards
    members = layout(bad)
    bad.write_bytes(bad.read_bytes()[: members[30][0]])
    keys, counters, _, _ = run(pattern)
    assert set(keys) == damaged_keys(30)
    assert loss(counters) == (0, 0, 0, 0)


def test_corrupt_header_mid_shard_counts_the_rest_in_bytes(shards: tuple[str, list[Path]]) -> None:
    # Member 30's header corrupt (bad checksum): 29 is held back (counted), and what follows cannot be
    # counted in samples: one shard with an unknown rest, its bytes from 29's header to the file's end.
    pattern, (_, bad) = shards
    members = layout(bad)
    data = bytearray(bad.read_bytes())
    data[members[30][0] + 20] ^= 0x10
    bad.write_bytes(bytes(data))
    keys, counters, _, caught = run(pattern)
    assert set(keys) == damaged_keys(29)
    assert loss(counters) == (1, 1, 1, len(data) - members[29][0])
    [warning] = [w for w in caught if "skipping" in w]
    assert f"rest of shard unknown: {len(data) - members[29][0]} bytes from offset {members[29][0]} skipped" in warning


def test_empty_and_non_tar_files_are_named_and_counted(shards: tuple[str, list[Path]]) -> None:
    pattern, (_, bad) = shards
    bad.write_bytes(b"")
    keys, counters, _, caught = run(pattern)
    assert set(keys) == damaged_keys(0)
    assert loss(counters) == (0, 1, 0, 0)  # an empty file: nothing in it was lost
    assert any("d-000001.tar: empty file (0 bytes), not a tar shard" in w for w in caught)

    bad.write_bytes(b"<html>not found</html>\n" * 40)
    keys, counters, _, caught = run(pattern)
    assert set(keys) == damaged_keys(0)
    assert loss(counters) == (0, 1, 1, 23 * 40)
    assert any("d-000001.tar: not a tar file (starts with b'<html>not found<'" in w for w in caught)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_shared_by_readers_is_counted_once(tmp_path: Path, workers: int) -> None:
    # One shard, read by every reader (each keeps the samples i % readers == part): the cut sample is
    # counted by the reader it belonged to, the shard and its bytes once, whatever the readers.
    pattern = write_token_shards(tmp_path, "d", [[8] * N])
    path = tmp_path / "d-000000.tar"
    members = layout(path)
    cut = members[31][1] + 7
    path.write_bytes(path.read_bytes()[:cut])
    keys, counters, _, _ = run(pattern, workers=workers)
    assert set(keys) == {token_key("d", 0, i) for i in range(31)}
    assert loss(counters) == (1, 1, 0, cut - members[31][0])


def test_resume_after_a_skip_delivers_the_same_samples(shards: tuple[str, list[Path]]) -> None:
    # The skip decision (how many samples of the damaged shard were read) travels in the state: a
    # resumed run delivers what the uninterrupted one did and counts the loss once.
    from resume_oracle import assert_resumes_exactly, batch_view

    pattern, (_, bad) = shards
    members = layout(bad)
    bad.write_bytes(bad.read_bytes()[: members[30][1] + 100])
    mix = mixer.Mixture(
        [mixer.Source("d", pattern, on_error="skip")],
        batching=mixer.TokenBudget(max_tokens=256),
        stop="all_exhausted",
        shuffle_buffer=8,
        state_every=1,
        seed=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        reference = assert_resumes_exactly(lambda: mixer.make_loader(mix), cuts=[3, 9], window=60, view=batch_view)
    assert sum(len(view[0]) for view in reference) == 2 * N - 10


def test_a_resumed_run_counts_the_loss_as_the_uninterrupted_one(shards: tuple[str, list[Path]]) -> None:
    # With state_every=8 a resumed reader re-runs the batches since the last full state and meets the
    # damaged shard again. Here the shard has been repaired meanwhile (as when the damage was a
    # network failure that does not recur): the skip decision carried by the batches must stop it
    # at the same sample as the uninterrupted run, deliver the same batches, and count the same loss
    # (not a finished shard).
    import json

    from resume_oracle import batch_view, take

    pattern, (_, bad) = shards
    members = layout(bad)
    intact = bad.read_bytes()
    cut_at = members[30][1] + 100
    bad.write_bytes(intact[:cut_at])
    mix = mixer.Mixture(
        [mixer.Source("d", pattern, on_error="skip")],
        batching=mixer.TokenBudget(max_tokens=256),
        stop="all_exhausted",
        shuffle_buffer=4,
        state_every=8,
        seed=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        whole = mixer.make_loader(mix)
        reference = [batch_view(b) for b in whole]
        want = whole.counters()["d"]
        assert loss(want) == (1, 1, 0, cut_at - members[30][0]) and want["shards_finished"] == 1
        tested = 0
        for cut in range(1, len(reference)):
            bad.write_bytes(intact[:cut_at])
            loader = mixer.make_loader(mix)
            take(loader, cut)
            state = json.loads(json.dumps(loader.state_dict()))
            if not any(r["skips"] for r in state["readers"]):
                continue  # the decision is not between the last full state and the cut
            tested += 1
            bad.write_bytes(intact)
            resumed = mixer.make_loader(mix)
            resumed.load_state_dict(state)
            rest = [batch_view(b) for b in resumed]
            assert len(rest) == len(reference) - cut
            assert all(a[0] == b[0] for a, b in zip(rest, reference[cut:])), f"cut {cut}"
            assert resumed.counters()["d"] == want, f"cut {cut}"
    assert tested >= 2, "too few cuts fell between a full state and the skip decision"
