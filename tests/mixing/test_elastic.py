"""Elastic resume: a run saved on W ranks x N workers continues on W' x N', every sample of every
source-epoch delivered exactly once across the change (mixer.mixing.elastic).

Ranks are simulated in one process (each rank's Mixture gets its rank and world_size explicitly);
workers are real DataLoader workers. Every state goes through JSON, as a checkpoint would.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np
import pytest
import shardutil
from resume_oracle import _equal, batch_view, save_along_one_run, tail_cuts, take
from shardutil import LogNormal, expected_tokens

import mixer
from mixer.mixing import elastic
from mixer.plan.shards import plan, plan_all, slice_of
from mixer.plan.world import World
from mixer.state.checkpoint import readable

# Their own spec (own folder): the index tests write index files next to the shards.
SOURCES = {
    "web": LogNormal(shards=6, samples=240, median=90, sigma=0.8, lo=2, hi=1000, seed=10),
    "code": LogNormal(shards=3, samples=90, median=250, sigma=1.0, lo=2, hi=1000, seed=11),
    "tiny": LogNormal(shards=2, samples=24, median=40, sigma=0.5, lo=2, hi=1000, seed=12),
}
NAMES = tuple(SOURCES)


@pytest.fixture(scope="module")
def shards(make_sources):
    return make_sources(SOURCES)


def build(shards, *, rank, world_size, index=False, **options):
    options = {
        "weights": {"web": 0.5, "code": 0.3, "tiny": 0.2},
        "batching": mixer.TokenBudget(max_tokens=1024),
        "state_every": 3,
        "shuffle_buffer": 16,
        "seed": 7,
        **options,
    }
    return shardutil.mixture(
        shards, source_options={"index": True} if index else None, rank=rank, world_size=world_size, **options
    )


def run_old(shards, world_size, num_workers, cuts, **options):
    """Each old rank hands out ``cuts[rank]`` batches and saves its state; returns the states and the
    batches handed out, per (rank, worker)."""
    states, got = [], defaultdict(list)
    for rank in range(world_size):
        loader = mixer.make_loader(build(shards, rank=rank, world_size=world_size, **options), num_workers=num_workers)
        for b in take(loader, cuts[rank]):
            got[rank, b.meta.worker].append(b)
        states.append(json.loads(json.dumps(loader.state_dict())))
    return states, got


def run_old_at_many_cuts(shards, world_size, num_workers, cut_lists, **options):
    """:func:`run_old` for each per-rank list of ``cut_lists``, from one pass per old rank: a rank's
    loader saves its state after each count it is cut at and goes on, as a training loop
    checkpoints (a pass per rank, not one per cut). Returns one ``(states, batches)`` per list."""
    passes = []
    for rank in range(world_size):
        wanted = {cuts[rank] for cuts in cut_lists}
        loader = mixer.make_loader(build(shards, rank=rank, world_size=world_size, **options), num_workers=num_workers)
        batches, saved = save_along_one_run(loader, wanted, until=max(wanted))
        assert wanted <= set(saved), f"rank {rank} ended after {len(batches)} batches, before its cuts {sorted(wanted)}"
        passes.append((batches, saved))
    out = []
    for cuts in cut_lists:
        got = defaultdict(list)
        for rank, (batches, _) in enumerate(passes):
            for b in batches[: cuts[rank]]:
                got[rank, b.meta.worker].append(b)
        out.append(([saved[cuts[rank]] for rank, (_, saved) in enumerate(passes)], got))
    return out


def resume(shards, world_size, num_workers, states, *, batches=None, **options):
    """The new ranks, each loading the list of all old states; their batches per (rank, worker)
    (all of them, or the first ``batches`` per rank)."""
    got = defaultdict(list)
    for rank in range(world_size):
        loader = mixer.make_loader(build(shards, rank=rank, world_size=world_size, **options), num_workers=num_workers)
        loader.load_state_dict(json.loads(json.dumps(states)))
        for b in take(loader, batches) if batches is not None else loader:
            got[rank, b.meta.worker].append(b)
    return got


def delivered(*runs):
    """Counter of (key) over the batches of several runs, checking every sample's tokens."""
    seen = Counter()
    for run in runs:
        for batches in run.values():
            for b in batches:
                for k, key in enumerate(b.keys):
                    n = int(b.lengths[k])
                    np.testing.assert_array_equal(b.tokens[k, :n].numpy(), expected_tokens(key, n))
                    seen[key] += 1
    return seen


def every_key(shards):
    return {k for _, lengths in shards.values() for k in lengths}


# (old world, old workers, new world, new workers, batches each old rank hands out)
SHAPES = [
    pytest.param(2, 2, 3, 1, [5, 4], id="2x2-3x1"),
    pytest.param(3, 1, 2, 3, [30, 25, 20], id="3x1-2x3"),
    pytest.param(1, 0, 2, 2, [7], id="1x0-2x2"),
    pytest.param(2, 1, 3, 0, [7, 0], id="2x1-3x0-rank1-before-its-first-batch"),
]


@pytest.mark.parametrize("index", [False, True], ids=["no-index", "index"])
@pytest.mark.parametrize("w, n, w2, n2, cuts", SHAPES)
def test_every_sample_once_across_the_change_all_exhausted(shards, w, n, w2, n2, cuts, index):
    states, old = run_old(shards, w, n, cuts, stop="all_exhausted", index=index)
    # state_every=3: some readers were saved between snapshots, so they are replayed to settle
    assert any(r["replay"] for s in states for r in s["readers"])
    new = resume(shards, w2, n2, states, stop="all_exhausted", index=index)
    seen = delivered(old, new)
    assert set(seen) == every_key(shards)
    assert max(seen.values()) == 1
    # the old run really stopped part-way, and the new one did the rest over all its readers
    assert 0 < sum(map(len, old.values())) and len(new) == w2 * max(n2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("w, n, w2, n2", [(1, 3, 2, 1), (2, 2, 3, 1)], ids=["1x3-2x1", "2x2-3x1"])
def test_every_cut_in_the_tail_of_the_old_pass(shards, w, n, w2, n2):
    """The resume oracle's tail cuts, elastically: each old rank saved at every one of its pass's last
    ``tail_cuts`` batches (readers ended at different points), every sample still delivered once.
    (The states come from one pass per old rank; :func:`run_old`, a loader stopped at its cut, is
    what the other tests use.)"""
    opts = {"stop": "all_exhausted"}
    lengths = [
        sum(1 for _ in mixer.make_loader(build(shards, rank=r, world_size=w, **opts), num_workers=n)) for r in range(w)
    ]
    tail = tail_cuts(n)
    assert min(lengths) > tail
    cut_lists = [[length - back for length in lengths] for back in range(tail + 1)]
    for back, (states, old) in enumerate(run_old_at_many_cuts(shards, w, n, cut_lists, **opts)):
        new = resume(shards, w2, n2, states, **opts)
        seen = delivered(old, new)
        assert set(seen) == every_key(shards), f"cut {back} batches before the end: samples lost"
        assert max(seen.values()) == 1, f"cut {back} batches before the end: samples twice"


def test_mix_sample_and_a_second_change(shards):
    """Shared buckets (mix="sample") hold (source, sample) pairs; and an elastic resume of an elastic
    resume (the old readers still hold inherited slices)."""
    opts = {"stop": "all_exhausted", "mix": "sample"}
    states, first = run_old(shards, 2, 1, [4, 3], **opts)
    second_states, second = [], defaultdict(list)
    for rank in range(3):
        loader = mixer.make_loader(build(shards, rank=rank, world_size=3, **opts), num_workers=1)
        loader.load_state_dict(json.loads(json.dumps(states)))
        for b in take(loader, 2):
            second[rank, b.meta.worker].append(b)
        second_states.append(json.loads(json.dumps(loader.state_dict())))
    held = [readable(r["snapshot"]) for s in second_states for r in s["readers"] if r["snapshot"] is not None]
    assert any(st["inherit"] for r in held for st in r["streams"]), (
        "some second-run reader should still hold inherited slices"
    )
    third = resume(shards, 1, 2, second_states, **opts)
    seen = delivered(first, second, third)
    assert set(seen) == every_key(shards) and max(seen.values()) == 1


def test_packed_rows_go_back_to_the_streams_and_split_documents_are_refused(shards):
    """A packer's open rows and ready batches hold whole documents (by location): they are read
    again by the new readers. With split_documents a row may hold the tail of a delivered head."""
    opts = {"stop": "all_exhausted", "batching": mixer.Packed(max_tokens=2048, seq_len=1024)}
    states, old = run_old(shards, 2, 1, [4, 5], **opts)
    held = [readable(r["snapshot"])["batchers"] for s in states for r in s["readers"] if r["snapshot"] is not None]
    assert any(b["buffers"] or b["ready"] for bs in held for b in bs), "the packers should hold documents at the cut"
    new = resume(shards, 1, 2, states, **opts)
    seen = Counter(k for run in (old, new) for batches in run.values() for b in batches for k in b.keys)
    assert set(seen) == every_key(shards) and max(seen.values()) == 1
    split = {"stop": "all_exhausted", "batching": mixer.Packed(max_tokens=2048, seq_len=1024, split_documents=True)}
    states, _ = run_old(shards, 2, 1, [2, 2], **split)
    with pytest.raises(mixer.StateError, match="split_documents"):
        mixer.make_loader(build(shards, rank=0, world_size=1, **split)).load_state_dict(states)


# ---- stop="never" across a source-epoch boundary, counted per source-epoch ------------------------

# FIFO per reader: no shuffle buffer and one bucket, so each reader delivers a source's samples in
# the order it reads them, and the epoch of every delivered sample follows from the plans.
FIFO = {
    "stop": "never",
    "shuffle_buffer": 0,
    "batching": mixer.TokenBudget(max_tokens=1024, buckets=[1024]),
    "weights": {"web": 0.3, "code": 0.2, "tiny": 0.5},
}


def slice_keys(sl, counts, name):
    stop = sl.stop if sl.stop is not None else counts[sl.shard]
    return [
        shardutil.token_key(name, sl.shard, i)
        for i in range(sl.start, stop)
        if sl.parts == 1 or i % sl.parts == sl.part
    ]


def planned(shards, world, epoch, name, index):
    counts = Counter(int(k.split("-")[1]) for k in shards[name][1])
    idx = mixer.load_index(shards[name][0]) if index else None
    sizes = build(shards, rank=0, world_size=1, index=index, **FIFO).listed[NAMES.index(name)].shard_bytes
    return [
        k
        for sl in plan(len(counts), world, seed=7, source=name, epoch=epoch, sizes=sizes, index=idx)
        for k in slice_keys(sl, counts, name)
    ]


@pytest.mark.parametrize("index", [False, True], ids=["no-index", "index"])
@pytest.mark.parametrize(
    "w, n, w2, n2, cuts",
    [
        pytest.param(2, 2, 3, 1, [38, 33], id="2x2-3x1"),
        pytest.param(3, 1, 2, 3, [30, 25, 20], id="3x1-2x3"),
        pytest.param(1, 0, 2, 2, [40], id="1x0-2x2"),
    ],
)
def test_every_sample_once_per_source_epoch_with_stop_never(shards, w, n, w2, n2, cuts, index):
    name = "tiny"
    counts = Counter(int(k.split("-")[1]) for k in shards[name][1])
    states, old = run_old(shards, w, n, cuts, index=index, **FIFO)
    tagged = Counter()  # (epoch, key) delivered; epoch -1: an epoch <= last, inherited
    for (rank, worker), batches in old.items():
        world = World(rank=rank, world_size=w, worker=worker, num_workers=max(n, 1))
        mine = [k for b in batches for k in b.keys if k.startswith(name)]
        e, read = 0, []
        while len(read) < len(mine):
            read += [(e, k) for k in planned(shards, world, e, name, index)]
            e += 1
        assert [k for _, k in read[: len(mine)]] == mine  # FIFO: delivered in reading order
        tagged.update(read[: len(mine)])
    new_states = [
        elastic.resume_state(
            build(shards, rank=r, world_size=w2, index=index, **FIFO), json.loads(json.dumps(states)), num_workers=n2
        )
        for r in range(w2)
    ]
    last = max(readable(r["snapshot"])["streams"][NAMES.index(name)]["epoch"] for s in new_states for r in s["readers"])
    assert last >= 1, "the cut should come after some old reader crossed into epoch 1 of 'tiny'"
    if w * max(n, 1) > 1:  # old readers in different epochs: the ones behind leave whole planned epochs
        old_mix = build(shards, rank=0, world_size=w, index=index, **FIFO)
        stood = [
            elastic.settle(old_mix, World(rank=r, world_size=w, worker=j, num_workers=n), states[r]["readers"][j])
            for r in range(w)
            for j in range(n)
        ]
        assert len({s.streams[NAMES.index(name)]["epoch"] for s in stood}) > 1
    new = resume(shards, w2, n2, states, batches=80, index=index, **FIFO)
    for rank, s in enumerate(new_states):
        for j, r in enumerate(s["readers"]):
            st = readable(r["snapshot"])["streams"][NAMES.index(name)]
            inherited = len(st["buffer"]) + sum(
                len(slice_keys(slice_of(row, "test"), counts, name)) for row in st["inherit"]
            )
            mine = [k for b in new[rank, j] for k in b.keys if k.startswith(name)]
            world = World(rank=rank, world_size=w2, worker=j, num_workers=max(n2, 1))
            after = planned(shards, world, last + 1, name, index)
            assert len(mine) >= inherited + len(after), "run the new world past its first planned epoch of 'tiny'"
            tagged.update((-1, k) for k in mine[:inherited])
            assert mine[inherited : inherited + len(after)] == after  # then the new world's plan, in order
            tagged.update((last + 1, k) for k in after)
    keys = set(shards[name][1])
    # epochs 0..last: what the old run delivered of them plus what the new one inherited, each key last + 1 times
    up_to_last = Counter()
    for (e, k), c in tagged.items():
        if e <= last:
            up_to_last[k] += c
    assert up_to_last == Counter({k: last + 1 for k in keys})
    assert Counter(k for (e, k) in tagged.elements() if e == last + 1) == Counter(keys)


# ---- same shape, refusals ---------------------------------------------------------------------------


def test_the_same_shape_from_a_list_resumes_batch_for_batch(shards):
    states, _ = run_old(shards, 2, 1, [5, 7])
    reference = [
        batch_view(b) for b in take(mixer.make_loader(build(shards, rank=1, world_size=2), num_workers=1), 19)
    ][7:]
    loader = mixer.make_loader(build(shards, rank=1, world_size=2), num_workers=1)
    loader.load_state_dict(states)
    got = [batch_view(b) for b in take(loader, 12)]
    assert len(got) == len(reference) and all(_equal(a, b) for a, b in zip(reference, got))


def test_states_of_another_mixture_or_an_incomplete_list_are_refused(shards):
    states, _ = run_old(shards, 2, 1, [3, 3])
    other = mixer.make_loader(build(shards, rank=0, world_size=3, seed=8), num_workers=0)
    with pytest.raises(mixer.StateError, match="different mixture"):
        other.load_state_dict(states)
    loader = mixer.make_loader(build(shards, rank=0, world_size=3), num_workers=0)
    with pytest.raises(mixer.StateError, match=r"every one of the 2 saved ranks.*missing ranks \[1\]"):
        loader.load_state_dict(states[:1])
    with pytest.raises(mixer.StateError, match="non-empty list"):
        loader.load_state_dict([])
    # one rank's state alone still refuses another shape, and says how to resume elastically
    with pytest.raises(mixer.StateError, match="num_workers or world_size.*list of the states of all the saved ranks"):
        loader.load_state_dict(states[0])


@pytest.mark.parametrize("index", [False, True], ids=["no-index", "index"])
def test_the_whole_world_plan_at_once_is_every_reader_s_plan(shards, index):
    """The old world's plans are computed once per source-epoch for all its readers (plan_all): they
    must be exactly what each reader planned for itself (by size, round-robin, in-shard split, ranges)."""
    for name, (pattern, _) in shards.items():
        listed = build(shards, rank=0, world_size=1, index=index).listed[NAMES.index(name)]
        for readers in (1, 2, 5, 8):
            for sizes in (listed.shard_bytes, None):
                for epoch in (0, 3):
                    kw = {"seed": 7, "source": name, "epoch": epoch, "sizes": sizes, "index": listed.index}
                    alone = [plan(len(listed.shards), World(rank=k, world_size=readers), **kw) for k in range(readers)]
                    assert plan_all(len(listed.shards), readers, **kw) == alone


def test_the_re_split_is_balanced_by_bytes():
    sizes = [900, 500, 400, 300, 300, 100, 100, 100]
    owner = elastic.deal(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(3)]
    assert sorted(loads) == [900, 900, 900]  # 900 | 500+400 | 300+300+100+100+100
    assert elastic.deal([5, 5], 4) == [0, 1]


# ---- torchrun: 2 processes save, 3 resume ----------------------------------------------------------


@pytest.mark.slow
def test_torchrun_two_ranks_saved_three_resume_every_sample_once(shards, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from servers import free_port

    repo = Path(__file__).resolve().parents[2]
    weights = {"web": 0.5, "code": 0.3, "tiny": 0.2}
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"sources": [[n, shards[n][0], w] for n, w in weights.items()], "cuts": [6, 4], "workers": [1, 2]})
    )
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    )
    for nproc, phase in ((2, "save"), (3, "resume")):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(repo / "tests" / "support" / "elastic_worker.py"),
            str(spec),
            str(tmp_path),
            phase,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=repo)
        assert proc.returncode == 0, f"torchrun {phase} x{nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    saved = [json.loads((tmp_path / f"save-rank{r}.json").read_text()) for r in range(2)]
    resumed = [json.loads((tmp_path / f"resume-rank{r}.json").read_text()) for r in range(3)]
    assert [len(k) > 0 for k in saved] == [True, True] and all(resumed)
    seen = Counter(k for keys in (*saved, *resumed) for k in keys)
    assert set(seen) == every_key(shards) and max(seen.values()) == 1


def test_the_merged_selectors_owe_what_the_old_readers_owed_together():
    """Deficit: the new readers' (target - delivered) sum to the old readers' sum, per source, each
    new reader on one reader's scale; random: the mean amount per pick is the whole run's."""
    from mixer.mixing.selector import Deficit, RandomPick, RoundRobin

    olds = []
    for k, picks in enumerate([[0, 1, 1], [2, 2, 0, 1], [1]]):
        d = Deficit(3)
        for i in picks:
            d.update(i, 100.0 + 10 * k, np.array([0.5, 0.3, 0.2]))
        olds.append(d)
    news = [elastic.merge_selector(olds, Deficit(3), 2) for _ in range(2)]
    owed = sum(d.target - d.delivered for d in olds)
    np.testing.assert_allclose(sum(d.target - d.delivered for d in news), owed)
    np.testing.assert_allclose(news[0].delivered, sum(d.delivered for d in olds) / 2)
    r_olds = [RandomPick(2, seed=0, stream=(k,)) for k in range(3)]
    for k, r in enumerate(r_olds):
        r.update(0, 10.0 * (k + 1), np.ones(2))
        r.update(1, 4.0, np.ones(2))
    merged = elastic.merge_selector(r_olds, RandomPick(2, seed=0, stream=(9,)), 4)
    np.testing.assert_allclose(merged.amount / merged.picks, [60.0 / 3, 4.0])
    rr = RoundRobin(3)
    rr.next = 2
    assert elastic.merge_selector([rr], RoundRobin(3), 5).next == 2
