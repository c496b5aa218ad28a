"""Real multi-process runs under `torchrun` (gloo on CPU, 127.0.0.1): disjoint and complete data per
rank, equal batch counts in finite modes (fillers by default, every sample exactly once; or dropping
with ``sync_end="drop"``), and exact resume per rank, also from inside a rank's filler phase.

Each world size costs two launches (a run that saves a state on every rank, then a resume from it):
tests/support/dist_worker.py runs every case of the spec in one process group and writes per-rank JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hangs import communicate_or_explain
from servers import free_port
from shardutil import LogNormal

import mixer

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "dist_worker.py"

# Shard sizes (samples per shard) chosen so that ranks naturally end after different numbers of
# batches: 'web' and 'code' are split unevenly by bytes, and only one shard of 'tiny' holds data, so
# with 2 or 3 ranks (and 2 workers each) some ranks get no 'tiny' at all. In 'empty' only the first
# shard of each source holds data: it goes to reader 0 (rank 0), so the other ranks have no data.
SKEW = {
    "web": ([90, 50, 30, 20, 12, 6], 80, 0.6),
    "code": ([40, 25, 10], 200, 0.3),
    "tiny": ([12, 0, 0, 0, 0, 0], 60, 0.03),
}
EMPTY = {"a": ([30, 0, 0, 0, 0, 0], 80, 0.7), "b": ([10, 0, 0, 0, 0, 0], 150, 0.3)}
# Many small shards of unequal sizes: each of 6 readers (2 ranks x 3 workers) ends a few batches
# apart from the others, in the pass's tail.
TAIL = {
    "web": ([9, 7, 5, 3, 8, 6, 4, 2, 9, 5, 3, 7, 6, 2, 4, 8, 5, 3], 90, 0.6),
    "code": ([6, 3, 5, 2, 4, 1, 3], 260, 0.4),
}
MAX_TOKENS = 1024


def _write(make_sources: Any, spec: dict[str, tuple[list[int], int, float]]) -> dict[str, Any]:
    written = make_sources(
        {
            name: LogNormal(shards=tuple(sizes), median=median, sigma=0.6, lo=4, hi=MAX_TOKENS, seed=seed)
            for seed, (name, (sizes, median, _)) in enumerate(spec.items())
        }
    )
    return {
        name: {"pattern": written[name][0], "weight": weight, "keys": sorted(written[name][1])}
        for name, (_, _, weight) in spec.items()
    }


@pytest.fixture(scope="module")
def datasets(make_sources: Any) -> dict[str, dict[str, Any]]:
    return {
        "skew": _write(make_sources, SKEW),
        "empty": _write(make_sources, EMPTY),
        "tail": _write(make_sources, TAIL),
    }


def _cases(datasets: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    def sources(name: str) -> list[dict[str, Any]]:
        return [{"name": n, "pattern": d["pattern"], "weight": d["weight"]} for n, d in datasets[name].items()]

    cases = []
    for stop, save_at in (("all_exhausted", 7), ("first_exhausted", 3)):
        short = stop.split("_")[0]
        for nw in (0, 2):
            for end in ("pad", "drop"):
                name = f"{short}-w{nw}" + ("-drop" if end == "drop" else "")
                cases.append(
                    {
                        "name": name,
                        "data": "skew",
                        "sources": sources("skew"),
                        "stop": stop,
                        "num_workers": nw,
                        "save_at": save_at,
                        "sync_end": end,
                    }
                )
        # the same without the sync: what each rank's stream naturally holds
        cases.append(
            {
                "name": f"{short}-nosync",
                "data": "skew",
                "sources": sources("skew"),
                "stop": stop,
                "num_workers": 0,
                "sync_stop": False,
            }
        )
    # saved one batch into the filler phase of the rank that ends first
    for nw in (0, 2):
        cases.append(
            {
                "name": f"all-w{nw}-fill",
                "data": "skew",
                "sources": sources("skew"),
                "stop": "all_exhausted",
                "num_workers": nw,
                "save_at": "filler",
            }
        )
    # the group given explicitly, and a gloo side group (what an NCCL-only group gets)
    for group in ("explicit", "side"):
        for end in ("pad", "drop"):
            name = f"all-{group}" + ("-drop" if end == "drop" else "")
            cases.append(
                {
                    "name": name,
                    "data": "skew",
                    "sources": sources("skew"),
                    "stop": "all_exhausted",
                    "num_workers": 0,
                    "group": group,
                    "sync_end": end,
                }
            )
    for nw in (0, 2):
        # pad: ranks without data have no batch of their own to copy; saved in their filler phase
        cases.append(
            {
                "name": f"empty-w{nw}",
                "data": "empty",
                "sources": sources("empty"),
                "stop": "all_exhausted",
                "num_workers": nw,
                "save_at": "filler",
            }
        )
        cases.append(
            {
                "name": f"empty-w{nw}-drop",
                "data": "empty",
                "sources": sources("empty"),
                "stop": "all_exhausted",
                "num_workers": nw,
                "sync_end": "drop",
            }
        )
    # every cut in the pass's tail, with 3 readers per rank that end at different points (2 ranks only)
    for end in ("pad", "drop"):
        name = "tail-w3" + ("-drop" if end == "drop" else "")
        cases.append(
            {
                "name": name,
                "data": "tail",
                "sources": sources("tail"),
                "stop": "all_exhausted",
                "num_workers": 3,
                "save_at": "tail",
                "tail": 3 * 3 + 6,
                "sync_end": end,
                "world": 2,
            }
        )
    # rank 0's reading fails after 120 samples, a few batches in: every rank must stop, none may hang
    for end in ("pad", "drop"):
        name = "fail" + ("-drop" if end == "drop" else "")
        cases.append(
            {
                "name": name,
                "data": "skew",
                "sources": sources("skew"),
                "stop": "all_exhausted",
                "num_workers": 0,
                "fail_rank": 0,
                "fail_after": 120,
                "sync_end": end,
            }
        )
    for c in cases:
        c["max_tokens"] = MAX_TOKENS
    return cases


def torchrun(nproc: int, spec: Path, out: Path, phase: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(WORKER),
        str(spec),
        str(out),
        phase,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",  # a hung run fails with every rank's stacks (communicate_or_explain)
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True
    )
    out, err = communicate_or_explain(proc, 180)
    assert proc.returncode == 0, f"torchrun {phase} x{nproc} failed:\n{out[-3000:]}\n{err[-6000:]}"


@pytest.fixture(scope="module", params=[2, 3], ids=["2proc", "3proc"])
def runs(
    request: pytest.FixtureRequest, datasets: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """``{"world": N, "cases": {name: case}, "run": {name: [rank results]}, "resume": {...}}``."""
    nproc = request.param
    out = tmp_path_factory.mktemp(f"dist{nproc}")
    cases = _cases(datasets)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    torchrun(nproc, spec, out, "run")
    torchrun(nproc, spec, out, "resume")

    def load(phase: str, name: str) -> list[dict[str, Any]]:
        return [json.loads((out / f"{name}-{phase}-rank{r}.json").read_text()) for r in range(nproc)]

    cases = [c for c in cases if c.get("world", nproc) == nproc]
    return {
        "world": nproc,
        "cases": {c["name"]: c for c in cases},
        "run": {c["name"]: load("run", c["name"]) for c in cases},
        "resume": {c["name"]: load("resume", c["name"]) for c in cases if c.get("save_at")},
    }


def _keys(rank_result: dict[str, Any]) -> list[str]:
    return [k for b in rank_result["batches"] if not b["filler"] for k in b["keys"]]  # fillers deliver nothing


def _by_source(keys: list[str], names: list[str]) -> Counter[str]:
    return Counter(k.rsplit("-", 2)[0] for k in keys if k.rsplit("-", 2)[0] in names)


def _assert_disjoint(per_rank: list[dict[str, Any]]) -> None:
    seen: dict[str, int] = {}
    for r, res in enumerate(per_rank):
        keys = _keys(res)
        assert len(keys) == len(set(keys)), f"rank {r} repeated a sample"
        for k in keys:
            assert k not in seen, f"{k} read by ranks {seen[k]} and {r}"
            seen[k] = r


@pytest.mark.slow
def test_without_the_sync_each_rank_reads_a_disjoint_part_and_together_everything(runs, datasets):
    world = runs["world"]
    everything = sorted(k for d in datasets["skew"].values() for k in d["keys"])
    for stop in ("all", "first"):
        per_rank = runs["run"][f"{stop}-nosync"]
        assert not any(r["synced"] for r in per_rank)
        _assert_disjoint(per_rank)
        counts = [len(r["batches"]) for r in per_rank]
        # the arrangement must make ranks differ, or the equal counts below would prove nothing
        assert len(set(counts)) > 1, counts
        if stop == "all":
            assert sorted(k for r in per_rank for k in _keys(r)) == everything
        # every rank reads part of every source, except 'tiny' (one shard of data: one reader)
        for name in ("web", "code"):
            assert all(_by_source(_keys(r), [name])[name] > 0 for r in per_rank), (world, name)
        tiny_ranks = [r for r in per_rank if _by_source(_keys(r), ["tiny"])["tiny"]]
        assert len(tiny_ranks) <= 1


def _real(rank_result: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for b in rank_result["batches"] if not b["filler"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["all-w0", "all-w2", "all-w0-fill", "all-w2-fill", "all-explicit", "all-side"])
def test_fillers_deliver_every_sample_exactly_once_with_equal_step_counts(runs, datasets, name):
    per_rank = runs["run"][name]
    assert all(r["synced"] and r["sync_end"] == "pad" and "error" not in r for r in per_rank)
    counts = [len(r["batches"]) for r in per_rank]
    assert len(set(counts)) == 1, f"unequal step counts {counts}"
    # every sample of every source exactly once over the ranks, in real batches only
    _assert_disjoint(per_rank)
    everything = sorted(k for d in datasets["skew"].values() for k in d["keys"])
    assert sorted(k for r in per_rank for k in _keys(r)) == everything
    real = [len(_real(r)) for r in per_rank]
    # the ranks really ended at different points, and the step count is the longest rank's
    assert len(set(real)) > 1, real
    assert counts[0] == max(real)
    for r, res in enumerate(per_rank):
        # fillers come only after the rank's last real batch, are marked, counted and never empty
        flags = [b["filler"] for b in res["batches"]]
        assert flags == [False] * real[r] + [True] * (counts[r] - real[r]), (r, flags)
        assert all(b["rows"] for b in res["batches"] if b["filler"])
        assert res["fillers"] == res["stats"]["fillers"] == counts[r] - real[r]
        assert res["dropped"]["batches"] == 0
        # stats count the real batches and samples, never the fillers
        assert res["stats"]["batches"] == real[r]
        assert res["stats"]["samples"] == {n: _by_source(_keys(res), [n])[n] for n in datasets["skew"]}
    if runs["cases"][name]["num_workers"] == 0:
        # what each rank handed out for real is exactly its natural (unsynced) stream
        nosync = runs["run"]["all-nosync"]
        assert [_real(r) for r in per_rank] == [r["batches"] for r in nosync]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["first-w0", "first-w2"])
def test_fillers_with_first_exhausted_hand_out_every_batch_each_rank_read(runs, name):
    per_rank = runs["run"][name]
    counts = [len(r["batches"]) for r in per_rank]
    real = [len(_real(r)) for r in per_rank]
    assert len(set(counts)) == 1 and counts[0] == max(real) and len(set(real)) > 1, (counts, real)
    _assert_disjoint(per_rank)
    assert [r["fillers"] for r in per_rank] == [c - n for c, n in zip(counts, real)]
    if name == "first-w0":
        assert [_real(r) for r in per_rank] == [r["batches"] for r in runs["run"]["first-nosync"]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["all-w0-drop", "all-w2-drop", "first-w0-drop", "first-w2-drop", "all-explicit-drop", "all-side-drop"]
)
def test_sync_end_drop_stops_with_the_first_rank_and_counts_what_it_drops(runs, datasets, name):
    per_rank = runs["run"][name]
    nosync = runs["run"][f"{name.split('-')[0]}-nosync"] if runs["cases"][name]["num_workers"] == 0 else None
    assert all(r["synced"] and r["sync_end"] == "drop" and "error" not in r and r["fillers"] == 0 for r in per_rank)
    assert not any(b["filler"] for r in per_rank for b in r["batches"])
    counts = [len(r["batches"]) for r in per_rank]
    assert len(set(counts)) == 1, f"unequal batch counts {counts}"
    _assert_disjoint(per_rank)
    if nosync is not None:
        natural = [len(r["batches"]) for r in nosync]
        # all ranks stop together after the shortest rank's last batch; the rest is dropped, counted
        assert counts[0] == min(natural)
        for r, (res, nat) in enumerate(zip(per_rank, natural)):
            assert res["dropped"]["batches"] == nat - counts[0], (r, res["dropped"], nat)
            # what was handed out is exactly the start of the rank's natural stream
            assert res["batches"] == nosync[r]["batches"][: counts[0]]
    if name.startswith("all"):
        # every sample exactly once across ranks, except the dropped ones, whose count is the difference
        for source, d in datasets["skew"].items():
            got = sum(_by_source(_keys(r), [source])[source] for r in per_rank)
            dropped = sum(r["dropped"]["sources"][source]["samples"] for r in per_rank)
            assert got + dropped == len(d["keys"]), (source, got, dropped)
        assert set(k for r in per_rank for k in _keys(r)) <= {k for d in datasets["skew"].values() for k in d["keys"]}
    assert min(r["dropped"]["batches"] for r in per_rank) == 0  # the rank that ended first dropped nothing
    assert max(r["dropped"]["batches"] for r in per_rank) > 0


@pytest.mark.slow
@pytest.mark.parametrize("nw", [0, 2])
def test_a_rank_without_any_data_still_takes_part_and_nobody_hangs(runs, datasets, nw):
    world = runs["world"]
    # pad: rank 0 holds every sample and hands it all out; the others, with no batch of their own
    # to copy, hand out fillers copied from rank 0's
    per_rank = runs["run"][f"empty-w{nw}"]
    n = len(per_rank[0]["batches"])
    assert n > 0 and [len(r["batches"]) for r in per_rank] == [n] * world
    assert sorted(_keys(per_rank[0])) == sorted(k for d in datasets["empty"].values() for k in d["keys"])
    assert per_rank[0]["fillers"] == 0
    for r in per_rank[1:]:
        assert r["fillers"] == n and all(b["filler"] and b["rows"] for b in r["batches"])
    # drop: all stop at once, rank 0 drops (and counts) it all
    per_rank = runs["run"][f"empty-w{nw}-drop"]
    assert [len(r["batches"]) for r in per_rank] == [0] * world
    for source, d in datasets["empty"].items():
        assert per_rank[0]["dropped"]["sources"][source]["samples"] == len(d["keys"])
        assert all(r["dropped"]["sources"][source]["samples"] == 0 for r in per_rank[1:])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fail", "fail-drop"])
def test_a_failing_rank_stops_every_rank(runs, name):
    per_rank = runs["run"][name]
    assert "injected read failure on rank 0" in json.dumps(per_rank[0]["error"])
    for r in range(1, runs["world"]):
        assert per_rank[r]["error"]["type"] == "MixerError"
        assert "another data-parallel rank failed" in per_rank[r]["error"]["message"]
    assert len({len(r["batches"]) for r in per_rank}) == 1 and per_rank[0]["batches"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["all-w0", "all-w2", "first-w0", "first-w2", "all-w0-drop", "all-w2-drop", "first-w0-drop", "first-w2-drop"]
)
def test_a_second_torchrun_resumes_every_rank_exactly(runs, name):
    k = runs["cases"][name]["save_at"]
    for r, (full, resumed) in enumerate(zip(runs["run"][name], runs["resume"][name])):
        assert "error" not in resumed
        assert len(full["batches"]) > k, "the state must be saved inside the stream"
        assert resumed["batches"] == full["batches"][k:], (
            f"rank {r}: the resumed run differs from the uninterrupted one"
        )
        assert resumed["dropped"] == full["dropped"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["all-w0-fill", "all-w2-fill", "empty-w0", "empty-w2"])
def test_a_state_saved_in_a_filler_phase_resumes_exactly(runs, name):
    """Saved right after the first filler of the rank that ended first: on resume that rank has no
    batch left and none of its own to copy, the others go on with theirs; the continuation must be
    the same real batches and the same fillers at the same steps (filler contents are copies and are
    not compared: they carry nothing)."""
    full, resumed = runs["run"][name], runs["resume"][name]
    k = full[0]["save_at"]
    assert all(r["save_at"] == k for r in full)
    in_filler = [r for r in full if r["batches"][k - 1]["filler"]]
    assert in_filler, "the state must be saved inside some rank's filler phase"
    assert any(not b["filler"] for r in full for b in r["batches"][k:]), "and some rank must still have real batches"
    for r, (f, res) in enumerate(zip(full, resumed)):
        assert "error" not in res
        assert res["batches"] == f["batches"][k:], f"rank {r}: the resumed run differs from the uninterrupted one"
        assert res["fillers"] == sum(b["filler"] for b in f["batches"][k:])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tail-w3", "tail-w3-drop"])
def test_every_cut_in_the_tail_resumes_every_rank_exactly(runs, name):
    """3 readers per rank ending at different points, fillers (pad) or a shared stop (drop): from every
    cut of the pass's last 15 batches each rank continues exactly as the uninterrupted run did."""
    if runs["world"] != 2:
        pytest.skip("the tail cases run with 2 ranks")
    full, resumed = runs["run"][name], runs["resume"][name]
    total = len(full[0]["batches"])
    assert all(len(r["batches"]) == total for r in full) and total > 15
    if name == "tail-w3":
        assert any(b["filler"] for r in full for b in r["batches"][-15:]), (
            "a rank should be in its filler phase in the tail"
        )
    for r, (f, res) in enumerate(zip(full, resumed)):
        assert "error" not in f and "error" not in res
        assert sorted(map(int, res["tail"])) == list(range(total - 15, total + 1))
        for cut, batches in res["tail"].items():
            assert batches == f["batches"][int(cut) :], (
                f"rank {r}, cut {cut}: the resumed run differs from the uninterrupted one"
            )


def test_sync_stop_needs_a_process_group_and_a_matching_group(datasets):
    d = datasets["skew"]
    srcs = [mixer.Source(n, v["pattern"], weight=v["weight"]) for n, v in d.items()]
    mix = mixer.Mixture(
        srcs, batching=mixer.TokenBudget(max_tokens=MAX_TOKENS), stop="all_exhausted", rank=1, world_size=2
    )
    assert mixer.make_loader(mix).sync is None  # no process group: each rank ends with its own stream
    with pytest.raises(mixer.ConfigError, match="needs an initialized torch.distributed process group"):
        mixer.make_loader(mix, sync_stop=True)
    with pytest.raises(mixer.ConfigError, match="sync_stop must be"):
        mixer.make_loader(mix, sync_stop="yes")
    with pytest.raises(mixer.ConfigError, match=r"sync_end must be one of \('pad', 'drop'\) \(got 'truncate'\)"):
        mixer.make_loader(mix, sync_end="truncate")
    for bad in (0, -1, float("inf"), float("nan"), "5", True, None):
        with pytest.raises(mixer.ConfigError, match=r"sync_timeout must be a number of seconds > 0 and finite \(got "):
            mixer.make_loader(mix, sync_timeout=bad)
    assert mixer.make_loader(mix, sync_timeout=2.5).sync is None  # validated even where no sync is made
    never = mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=MAX_TOKENS), rank=1, world_size=2)
    assert mixer.make_loader(never, sync_stop=True).sync is None  # an endless stream needs no agreement


@pytest.mark.slow
def test_train_ddp_example_resumes_loss_for_loss(demo_shards, tmp_path):
    """examples/train_ddp.py under torchrun (2 ranks, 1 worker each): a run of 6 steps that
    checkpoints at step 3, then a second run resumed from that checkpoint; steps 4-6 must see the
    same batches and, with the same model state, produce the same losses, bit for bit."""
    cache_dir = Path(demo_shards["prose"]).parents[2]
    script = REPO / "examples" / "train_ddp.py"
    common = [
        "--steps",
        "6",
        "--workers",
        "1",
        "--max-tokens",
        "4096",
        "--cache-dir",
        str(cache_dir),
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
    ]

    def launch(*args: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(script),
            *common,
            *args,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    launch("--ckpt-every", "3", "--log-dir", str(tmp_path / "full"))
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-000003").iterdir()) == [
        "data-rank0.pt",
        "data-rank1.pt",
        "model.pt",
    ]
    launch("--resume", str(tmp_path / "ckpt" / "step-000003"), "--log-dir", str(tmp_path / "resumed"))
    for rank in (0, 1):
        full = [json.loads(line) for line in (tmp_path / "full" / f"rank{rank}.jsonl").read_text().splitlines()]
        resumed = [json.loads(line) for line in (tmp_path / "resumed" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in full] == [1, 2, 3, 4, 5, 6]
        assert resumed == full[3:], f"rank {rank}: the resumed run differs from the uninterrupted one"
    # the two ranks read different data
    first = [json.loads((tmp_path / "full" / f"rank{r}.jsonl").read_text().splitlines()[0])["digest"] for r in (0, 1)]
    assert first[0] != first[1]


@pytest.mark.slow
def test_train_ddp_example_trains_on_every_demo_sample_once_with_zero_loss_fillers(demo_shards, tmp_path):
    """examples/train_ddp.py over a whole pass of the demo data (2 ranks, stop=all_exhausted): both
    ranks take the same number of steps, the real steps together train on every demo sample once,
    and the filler steps (some rank always ends first here) log a loss of exactly 0."""
    import tarfile

    cache_dir = Path(demo_shards["prose"]).parents[2]
    total = 0
    for pattern in demo_shards.values():
        for shard in sorted(Path(pattern).parent.glob("*.tar")):
            with tarfile.open(shard) as tar:
                total += len({m.name.split(".", 1)[0] for m in tar.getmembers() if m.isfile()})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(REPO / "examples" / "train_ddp.py"),
        "--steps",
        "100000",
        "--workers",
        "0",
        "--max-tokens",
        "4096",
        "--cache-dir",
        str(cache_dir),
        "--log-dir",
        str(tmp_path / "log"),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    logs = [
        [json.loads(line) for line in (tmp_path / "log" / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)
    ]
    assert len(logs[0]) == len(logs[1])
    assert sum(rec["keys"] for log in logs for rec in log) == total
    fillers = [rec for log in logs for rec in log if rec.get("filler")]
    assert fillers and all(rec["loss"] == 0.0 for rec in fillers)
    assert "filler step(s) (loss weighed by 0)" in proc.stderr


@pytest.mark.slow
def test_train_ddp_example_joins_its_gloo_threads_before_the_interpreter_exits(demo_shards, tmp_path):
    """examples/train_ddp.py as a one-rank job: when its main() returns, the process group is destroyed
    and its gloo threads joined. A gloo thread left running to interpreter exit can release DDP's last
    all_reduce after Python began to shut down and abort the process (seen under CPU load), so the
    example must not leave one, whatever the load."""
    probe = (
        "import glob, runpy, sys\n"
        "sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as done:\n"
        "    assert not done.code, done.code\n"
        "names = [open(t).read().strip() for t in glob.glob('/proc/self/task/*/comm')]\n"
        "print('gloo threads at exit:', sum(n.startswith('pt_gloo') for n in names))\n"
    )
    cmd = [sys.executable, "-c", probe, str(REPO / "examples" / "train_ddp.py"), "--steps", "2", "--workers", "0"]
    cmd += ["--max-tokens", "4096", "--cache-dir", str(Path(demo_shards["prose"]).parents[2])]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gloo threads at exit: 0" in proc.stdout, proc.stdout[-2000:]
