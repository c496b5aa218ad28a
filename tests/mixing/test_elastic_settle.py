"""Elastic resume settles once: a new rank reads only the saved states of the old readers it takes over
(mixer.mixing.leftover), and one all_reduce gives every rank the whole run's step and last epochs.

The all_reduce is simulated in one process exactly as it reduces: every new rank's own integers are
collected first, and each rank then gets their elementwise max. What each rank computes that way must
be, JSON for JSON, what it computes reading every saved state (the path without a process group,
which tests/test_elastic.py checks for exactly-once); under torchrun the real all_reduce is checked the
same way. Ranks are simulated in one process; every state goes through JSON.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import shardutil
from resume_oracle import take
from shardutil import LogNormal, expected_tokens

import mixer
from mixer.mixing import elastic
from mixer.mixing.leftover import Split, location_keys, location_rows, unique_sorted
from mixer.plan.shards import plan, plan_some
from mixer.plan.world import World
from mixer.state.columns import pack, unpack, unpack_rows

SOURCES = {
    "web": LogNormal(shards=7, samples=280, median=90, sigma=0.8, lo=2, hi=1000, seed=20),
    "code": LogNormal(shards=3, samples=90, median=250, sigma=1.0, lo=2, hi=1000, seed=21),
    "tiny": LogNormal(shards=2, samples=24, median=40, sigma=0.5, lo=2, hi=1000, seed=22),
}


@pytest.fixture(scope="module")
def shards(make_sources):
    return make_sources(SOURCES)


def build(shards, *, rank, world_size, **options):
    options = {
        "weights": {"web": 0.5, "code": 0.3, "tiny": 0.2},
        "batching": mixer.TokenBudget(max_tokens=1024),
        "state_every": 3,
        "shuffle_buffer": 16,
        "seed": 7,
        **options,
    }
    return shardutil.mixture(shards, rank=rank, world_size=world_size, **options)


def run_old(shards, world_size, num_workers, cuts, **options):
    states, got = [], defaultdict(list)
    for rank in range(world_size):
        loader = mixer.make_loader(build(shards, rank=rank, world_size=world_size, **options), num_workers=num_workers)
        for b in take(loader, cuts[rank]):
            got[rank, b.meta.worker].append(b)
        states.append(json.loads(json.dumps(loader.state_dict())))
    return states, got


class Files(Sequence[dict[str, Any]]):
    """Saved states read when asked for, as files would be; counts which ranks were read."""

    def __init__(self, states):
        self.texts = [json.dumps(s) for s in states]
        self.read = []

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, r):
        self.read.append(r)
        return json.loads(self.texts[r])


def with_simulated_all_reduce(shards, states, w2, n2, **options):
    """Every new rank's state through the agreement path (lazy files, max over the ranks' integers),
    and the old ranks each read."""
    sent = {}

    class Collected(Exception):
        pass

    def collect(rank):
        def agree(values):
            sent[rank] = values.copy()
            raise Collected

        return agree

    for rank in range(w2):
        with pytest.raises(Collected):
            elastic.resume_state(
                build(shards, rank=rank, world_size=w2, **options), Files(states), num_workers=n2, agree=collect(rank)
            )
    agreed = np.max(np.stack(list(sent.values())), axis=0)
    out, read = [], []
    for rank in range(w2):
        files = Files(states)
        mix = build(shards, rank=rank, world_size=w2, **options)
        out.append(elastic.resume_state(mix, files, num_workers=n2, agree=lambda v: np.maximum(v, agreed)))
        read.append(sorted(set(files.read)))
    return out, read


# (old world, old workers, new world, new workers, batches each old rank hands out): boundaries that cut
# old readers (6 -> 4, 4 -> 6 readers), whole ranks, growing and shrinking
SHAPES = [
    pytest.param(3, 2, 2, 2, [9, 7, 8], id="3x2-2x2"),
    pytest.param(2, 2, 3, 2, [8, 9], id="2x2-3x2"),
    pytest.param(4, 1, 3, 1, [6, 5, 7, 4], id="4x1-3x1"),
    pytest.param(2, 1, 5, 0, [9, 6], id="2x1-5x0"),
]


@pytest.mark.parametrize("stop", ["all_exhausted", "never"])
@pytest.mark.parametrize("w, n, w2, n2, cuts", SHAPES)
def test_the_agreement_gives_what_reading_every_state_gives(shards, w, n, w2, n2, cuts, stop):
    states, _ = run_old(shards, w, n, cuts, stop=stop)
    agreed, read = with_simulated_all_reduce(shards, states, w2, n2, stop=stop)
    for rank, state in enumerate(agreed):
        alone = elastic.resume_state(build(shards, rank=rank, world_size=w2, stop=stop), states, num_workers=n2)
        assert json.dumps(state, sort_keys=True) == json.dumps(alone, sort_keys=True), f"new rank {rank}"
    for rank, ranks in enumerate(read):
        # the old ranks its stretch overlaps, each read once: at most W / W' + 2 of the W
        split = Split(w * max(n, 1), w2 * max(n2, 1), max(n2, 1))
        ks = split.readers_of(rank)
        assert ranks == list(range(ks.start // max(n, 1), (ks.stop - 1) // max(n, 1) + 1))
        assert len(ranks) <= -(-w // w2) + 1


@pytest.mark.parametrize("w, n, w2, n2, cuts", SHAPES)
def test_every_sample_once_through_the_agreement(shards, w, n, w2, n2, cuts):
    opts = {"stop": "all_exhausted"}
    states, old = run_old(shards, w, n, cuts, **opts)
    new_states, _ = with_simulated_all_reduce(shards, states, w2, n2, **opts)
    seen = Counter()
    for batches in old.values():
        seen.update(k for b in batches for k in b.keys)
    for rank, state in enumerate(new_states):
        loader = mixer.make_loader(build(shards, rank=rank, world_size=w2, **opts), num_workers=n2)
        loader.load_state_dict(json.loads(json.dumps(state)))  # a state of the usual format for this rank
        for b in loader:
            for k, key in enumerate(b.keys):
                n_tok = int(b.lengths[k])
                np.testing.assert_array_equal(b.tokens[k, :n_tok].numpy(), expected_tokens(key, n_tok))
            seen.update(b.keys)
    every = {k for _, lengths in shards.values() for k in lengths}
    assert set(seen) == every and max(seen.values()) == 1


def test_the_new_readers_carry_the_old_totals(shards):
    """Counters sum over the new readers to the old sums; tokens and the deficit selector's owed
    amounts are the old readers' weighed by the parts taken, so they sum to the old totals too."""
    states, _ = run_old(shards, 3, 2, [9, 7, 8])
    new = [elastic.resume_state(build(shards, rank=r, world_size=2), states, num_workers=2) for r in range(2)]
    old_mix = build(shards, rank=0, world_size=3)
    olds = [  # where each old reader stood: replayed past its snapshot (state_every=3)
        mixer.state.checkpoint.readable(
            elastic.settled_snapshot(old_mix, World(rank=s["rank"], world_size=3, worker=w, num_workers=2), r)
        )
        for s in states
        for w, r in enumerate(s["readers"])
    ]
    assert any(r["replay"] for s in states for r in s["readers"])
    news = [mixer.state.checkpoint.readable(r["snapshot"]) for s in new for r in s["readers"]]
    assert (
        np.sum([o["counters"] for o in olds], axis=0).tolist() == np.sum([x["counters"] for x in news], axis=0).tolist()
    )
    old_tokens = sum(o["tokens"] for o in olds)
    assert old_tokens - len(news) < sum(x["tokens"] for x in news) <= old_tokens
    from mixer.state.columns import unpack_floats

    def owed(snap):
        sel = snap["selector"]
        return unpack_floats(sel["target"], 3, "t") - unpack_floats(sel["delivered"], 3, "d")

    np.testing.assert_allclose(sum(map(owed, news)), sum(map(owed, olds)), atol=1e-6)


def test_a_lazy_sequence_must_list_the_ranks_in_order_and_the_ranks_the_same_run(shards):
    states, _ = run_old(shards, 2, 1, [4, 3])
    mix = build(shards, rank=0, world_size=3)
    with pytest.raises(mixer.StateError, match=r"states\[0\] is the state of rank 1.*rank order"):
        elastic.resume_state(mix, Files(states[::-1]), num_workers=1, agree=lambda v: v)
    other = np.zeros(5 + 3, dtype=np.int64)
    other[1:5] = [3, -3, 1, -1]  # another rank was given a run of 3 ranks
    with pytest.raises(mixer.StateError, match="different saved runs"):
        elastic.resume_state(mix, Files(states), num_workers=1, agree=lambda v: np.maximum(v, other))


# ---- the pieces -------------------------------------------------------------------------------------


@pytest.mark.parametrize("old, new, per_rank", [(6, 4, 2), (4, 6, 2), (16, 12, 4), (7, 3, 1), (3, 7, 1), (5, 5, 5)])
def test_the_split_gives_every_item_one_rank_and_a_rank_few_old_readers(old, new, per_rank):
    split = Split(old, new, per_rank)
    ranks = new // per_rank
    for k in range(old):
        assert sum(split.overlap(r, k) for r in range(ranks)) == new  # an old reader's part, all of it
        assert split.overlap(*split.counted_on(k)[:1], k) > 0 and 0 <= split.counted_on(k)[1] < per_rank
        for n in (0, 1, 2, 5, 17):
            owners = [split.rank_at(k, 2 * j + 1, 2 * n) for j in range(n)]
            taken = [list(range(n))[split.take(k, n, r)] for r in range(ranks)]
            assert [j for part in taken for j in part] == list(range(n))  # each item once, in order
            assert all(owners[j] == r for r in range(ranks) for j in taken[r])
            assert all(split.overlap(owners[j], k) > 0 for j in range(n))  # only where its part lies
    for r in range(ranks):
        assert list(split.readers_of(r)) == [k for k in range(old) if split.overlap(r, k) > 0]


def test_locations_as_keys_keep_their_order_and_come_back():
    # (a text document's chunks: its offset + (k + 1) << 40, mixer.read.text)
    rows = np.array(
        [
            [0, 512],
            [0, 1024],
            [0, 1024 + (1 << 40)],
            [0, 1024 + (7 << 40)],
            [3, 0],
            [3, 1 << 39],
            [(1 << 32) - 1, 512 * 7],
        ],
        dtype=np.int64,
    )
    keys = location_keys(rows)
    assert (np.lexsort((keys[:, 1], keys[:, 0])) == np.arange(len(rows))).all()
    assert (location_rows(keys) == rows).all() and len(unique_sorted(keys[::-1])) == len(rows)
    for bad in ([[0, 100]], [[-1, 0]], [[0, 512 + (1 << 40) + 3]], [[1 << 32, 0]]):
        with pytest.raises(mixer.StateError, match="not a \\(shard, byte offset\\)"):
            location_keys(np.array(bad, dtype=np.int64))


def test_columns_of_location_arrays_and_their_rows():
    rng = np.random.default_rng(0)
    for _ in range(50):
        parts = [rng.integers(0, 99, size=(int(rng.integers(0, 4)), 2)) for _ in range(int(rng.integers(1, 5)))]
        as_lists = [p.tolist() for p in parts]
        text = pack(as_lists, 2)
        assert pack(parts, 2) == text  # the same column from arrays, without a Python object per row
        per, rows = unpack_rows(text, 2, len(parts), "t")
        assert per.tolist() == [len(p) for p in parts]
        assert rows.reshape(-1, 2).tolist() == [x for p in as_lists for x in p] or not any(as_lists)
        nested = [[[[*row, 1, 2, 3, 4] for row in p.tolist()] for _ in range(2)] for p in parts]  # packer pieces
        per, rows = unpack_rows(pack(nested, 3), 3, len(parts), "t")
        assert per.tolist() == [2 * len(p) for p in parts]
        assert (rows.tolist() if rows.size else []) == [x for part in nested for batch in part for x in batch]
        assert unpack(pack(nested, 3), 3, len(parts), "t") == nested
    with pytest.raises(mixer.StateError, match="expected 2"):
        unpack_rows(pack([[1, 2]], 1), 2, 1, "t")


@pytest.mark.parametrize("sized", [True, False])
def test_plan_some_is_each_reader_s_plan(shards, sized):
    rng = np.random.default_rng(1)
    for num_shards, readers in ((40, 7), (5, 12), (300, 64)):
        sizes = rng.integers(1, 10**6, num_shards).tolist() if sized else None
        ks = [0, 3, readers - 1]
        kw = {"seed": 7, "source": "s", "epoch": 2, "sizes": sizes}
        some = plan_some(num_shards, readers, ks, **kw)
        assert some == {k: plan(num_shards, World(rank=k, world_size=readers), **kw) for k in ks}


@pytest.mark.slow
def test_torchrun_the_all_reduce_gives_what_reading_every_state_gives(shards, tmp_path):
    """4 ranks save; 3 resume under torchrun: each loads the saved files lazily (one all_reduce over
    gloo) and also computes its state reading every file; the two are equal, and each rank read only
    the files of the old ranks it takes over."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from servers import free_port

    repo = Path(__file__).resolve().parents[2]
    here = repo / "tests" / "support"
    weights = {"web": 0.5, "code": 0.3, "tiny": 0.2}
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {"sources": [[n, shards[n][0], w] for n, w in weights.items()], "cuts": [6, 4, 5, 7], "workers": [2, 1]}
        )
    )
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(repo), str(here), os.environ.get("PYTHONPATH", "")]),
    )
    for nproc, script, phase in ((4, "elastic_worker.py", "save"), (3, "elastic_agree_worker.py", "agree")):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(here / script),
            str(spec),
            str(tmp_path),
            phase,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=here.parent)
        assert proc.returncode == 0, f"torchrun {phase} x{nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for rank in range(3):
        got = json.loads((tmp_path / f"agree-rank{rank}.json").read_text())
        assert got["agreed"] == got["alone"], f"new rank {rank}"
        split = Split(8, 3, 1)
        ks = split.readers_of(rank)
        assert got["read"] == list(range(ks.start // 2, (ks.stop - 1) // 2 + 1))
