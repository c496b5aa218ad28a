"""Elastic resume at world scale, simulated: what `load_state_dict` costs one new rank when the old run had
1,024 ranks x 16 workers over 100 sources.

    python -m benchmarks.world_scale_elastic [--quick]      # or through python -m benchmarks world_scale

No old reader runs. The old world's states are built as pure functions of (rank, worker, source) through
the real state code: every old reader's plan (`mixer.plan.shards.plan_some` over all 16,384 old readers,
shard sizes lognormal around 512 MB), a position part-way through its part of epoch 0 (a quarter of the
readers of every eighth source already in epoch 1), shuffle-buffer and bucket locations that fill the
default `buffer_budget` (65,536 samples per reader, apportioned by weight), deficit-selector totals and
counters, packed by `mixer.state.checkpoint.snapshot` and `pack_parts` as a reader packs them. Each old
rank's state is one JSON text (the file a rank saves), built only when a new rank reads it: the new rank
gets a sequence whose `states[r]` parses rank `r`'s text, as it would read the file, and counts the bytes.

What is measured, per new rank (two ranks per shape: the first and one in the middle):

* `load_state_dict` wall and CPU seconds: the real `Loader.load_state_dict`, with one piece simulated: the
  `all_reduce` (max) of a few integers over the new ranks. Its result (the most batches any old rank handed
  out, the last epoch any old reader reached, per source) is computed by the generator from all old
  readers, and handed to the rank in place of the collective (in a real run it is one all_reduce of
  5 + sources int64 over the process group);
* peak memory: tracemalloc over the same call (Python and numpy allocations), in a second run;
* bytes read: the JSON bytes of the old ranks' states the rank asked for, against its own share (all old
  states' bytes / new ranks; the bytes per old rank are the mean of the ranks built in this run);
* old ranks read: how many of the old world's states it asked for (the rest are never built);
* the worst new rank of the shape, from the split (exact, every rank): the most it reads against its
  share when a state is one file per old rank, and when a storage reads an old rank's readers one
  by one (a rank's ``"readers"`` given as a lazy sequence).

Beside it, the old path's lower bound in the same run: every new rank used to unpack every old reader's
snapshot (then re-read every buffered sample and rebuild readers, not counted here): the time of
`unpack_snapshot` on a sample of old readers times the old readers. The curve over old worlds of 64, 256
and 1,024 ranks (16 workers each) shows which cost grows with the world.

The same at 1,000 sources (median 2,048 shards each: most split in-shard over 16,384 readers), one
timed rank per shape. `--quick`: 10 sources, 4 / 8 / 16 old ranks x 4 workers, and a check that the
simulated agreement gives the states a rank computes by reading every saved state (`agree=None`),
JSON for JSON.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import numpy as np

NAME = "world_scale_elastic"
MEDIAN_BYTES = 512_000_000
BUCKETS = [256, 512, 1024, 2048, 4096, 8192]
BUDGET = 65_536  # Mixture's default buffer_budget: samples per reader in shuffle buffers and buckets
SHUFFLE = 1000
STEP = 48_000  # batches each old rank handed out (3,000 per worker at 16 workers)
MASK = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class Scale:
    sources: int
    shards: int  # median shards per source (lognormal, sigma 0.7, clipped to [shards / 8, shards * 4])
    workers: int  # old readers per rank
    worlds: tuple[int, ...]  # old world sizes (ranks)
    timed: int = 2  # new ranks timed per shape


SCALES = {
    "full": (
        Scale(sources=100, shards=16_384, workers=16, worlds=(64, 256, 1024)),
        Scale(sources=1000, shards=2048, workers=16, worlds=(64, 256, 1024), timed=1),
    ),
    "quick": (Scale(sources=10, shards=64, workers=4, worlds=(4, 8, 16)),),
    "smoke": (Scale(sources=10, shards=16, workers=2, worlds=(4, 8), timed=1),),
}


def shapes(world: int, workers: int) -> list[tuple[str, int, int]]:
    """New worlds (label, ranks, workers) for an old world of ``world`` x ``workers``."""
    return [
        ("shrink 3/4", world * 3 // 4, workers),
        ("half the workers", world, workers // 2),
        ("grow 5/4", world * 5 // 4, workers),
    ]


def _mix(*xs: int) -> int:
    """A 64-bit hash of integers (splitmix64 rounds): the generator's only randomness."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = ((h ^ (x & MASK)) * 0xBF58476D1CE4E5B9) & MASK
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & MASK
        h ^= h >> 29
    return h


def _u(*xs: int) -> float:
    return _mix(*xs) / 2.0**64


# ---- the data: sources listed without I/O ------------------------------------------------------


def build_mixture(scale: Scale, *, seed: int = 0) -> Any:
    """A Mixture of ``scale.sources`` sources of remote brace-pattern shards (listed without a request),
    with given sizes and bucket edges (looked at without a read), and the listing's shard byte sizes
    filled in as an object-store listing gives them (the plan splits by bytes)."""
    import mixer

    rng = np.random.default_rng([seed, scale.sources, scale.shards])
    counts = np.clip(
        np.rint(rng.lognormal(math.log(scale.shards), 0.7, scale.sources)), scale.shards // 8, scale.shards * 4
    )
    sources = [
        mixer.Source(
            f"s{i:04d}",
            f"https://data.example/s{i:04d}/shard-{{000000..{int(n) - 1:06d}}}.tar",
            weight=1 + i % 7,
            size=1e12,
        )
        for i, n in enumerate(counts.tolist())
    ]
    mix = mixer.Mixture(
        sources,
        batching=mixer.TokenBudget(max_tokens=65_536, buckets=BUCKETS),
        shuffle_buffer=SHUFFLE,
        seed=seed,
        rank=0,
        world_size=1,
    )
    for i, listed in enumerate(mix.listed):
        sizes = np.rint(rng.lognormal(math.log(MEDIAN_BYTES), 0.5, len(listed.shards))).astype(np.int64)
        mix.listed[i] = dataclasses.replace(listed, shard_bytes=tuple(sizes.tolist()))
    return mix


def at_rank(mix: Any, rank: int, world_size: int) -> Any:
    """The same mixture as rank ``rank`` of ``world_size`` (one listing for every simulated rank)."""
    other = copy.copy(mix)
    other.rank, other.world_size = rank, world_size
    return other


# ---- the old world: states as pure functions ----------------------------------------------------


class OldWorld:
    """The saved states of ``ranks`` x ``workers`` old readers of ``mix`` (see the module docstring)."""

    def __init__(self, mix: Any, ranks: int, workers: int) -> None:
        self.mix, self.ranks, self.workers = mix, ranks, workers
        self.readers = ranks * workers
        n = len(mix.listed)
        weights = np.array([s.weight for s in mix.sources], dtype=np.float64)
        total = np.floor(BUDGET * weights / weights.sum()).astype(np.int64)
        self.buffer = np.minimum(SHUFFLE, total // 2)  # per source: shuffle buffer, then bucket items
        self.items = total - self.buffer
        self.shares = weights / weights.sum()
        self.n = n

    def epoch(self, k: int, i: int) -> int:
        """Every eighth source: a quarter of its readers already crossed into epoch 1."""
        return int(i % 8 == 0 and _mix(k, i, 1) >> 62 == 0)

    def last_epochs(self) -> np.ndarray:
        """The last epoch any old reader reached, per source (what the new ranks agree on)."""
        return np.array(
            [
                max((self.epoch(k, i) for k in range(self.readers)), default=0) if i % 8 == 0 else 0
                for i in range(self.n)
            ]
        )

    def agreed(self) -> np.ndarray:
        """What the new ranks' all_reduce (max) gives: ``[step, W, -W, N, -N, E per source]``."""
        w, n = self.ranks, self.workers
        return np.asarray([STEP, w, -w, n, -n, *self.last_epochs().tolist()], dtype=np.int64)

    def state(self, r: int) -> dict[str, Any]:
        """Old rank ``r``'s loader state."""
        from mixer.plan.shards import plan_some
        from mixer.state import checkpoint

        ks = range(r * self.workers, (r + 1) * self.workers)
        plans = {}
        for i, listed in enumerate(self.mix.listed):
            for e in (0, 1) if i % 8 == 0 else (0,):
                plans[i, e] = plan_some(
                    len(listed.shards),
                    self.readers,
                    ks,
                    seed=self.mix.seed,
                    source=listed.name,
                    epoch=e,
                    sizes=listed.shard_bytes,
                )
        readers = [checkpoint.reader_state(self.snapshot(k, plans)) for k in ks]
        return checkpoint.loader_state(
            fingerprint=self.mix.fingerprint,
            rank=r,
            world_size=self.ranks,
            num_workers=self.workers,
            delivered=STEP,
            readers=readers,
            adaptive=None,
        )

    def text(self, r: int) -> str:
        return json.dumps(self.state(r), separators=(",", ":"))

    def snapshot(self, k: int, plans: dict[tuple[int, int], dict[int, list[Any]]]) -> dict[str, Any]:
        from mixer.batching.batchers import Bucketer
        from mixer.read.counters import Counters
        from mixer.state import checkpoint
        from mixer.state.columns import pack, pack_floats, pack_parts
        from mixer.stream.source_stream import SourceStream

        w = k % self.workers
        batches = STEP // self.workers + (w < STEP % self.workers)
        tokens = batches * 60_000
        streams, batchers = [], []
        for i in range(self.n):
            e = self.epoch(k, i)
            part = plans[i, e][k]
            pos = int((0.2 + 0.6 * _u(k, i, 2)) * len(part))
            here = [sl.shard for sl in part[max(pos - 1, 0) : pos + 1]] or [0]
            index = 1 + int(300 * _u(k, i, 3)) if pos < len(part) else 0
            stream = SourceStream.inheriting_state(
                epoch=e, buffer_size=SHUFFLE, buffer=_locations(here, int(self.buffer[i]), 0, _mix(k, i)), inherit=[]
            )
            stream.update(
                slice_pos=pos,
                next_index=index,
                next_offset=index * 50 * 512,
                got_in_epoch=pos * 400,
                draws=int(1e5 * _u(k, i, 4)),
                inherit_epoch=-1,
            )
            streams.append(stream)
            batchers.append(_bucketer_state(_locations(here, int(self.items[i]), 1, _mix(k, i)), batches))
        target = self.shares * tokens
        delivered = target * (1 + 0.01 * np.sin(np.arange(self.n) + k))
        counters = [[int(tokens * s) // 400, int(tokens * s)] + [0] * (len(Counters.FIELDS) - 2) for s in self.shares]
        return checkpoint.snapshot(
            batches=batches,
            tokens=tokens,
            active=pack([1] * self.n, 0),
            counters=pack(counters, 1),
            selector={"target": pack_floats(target), "delivered": pack_floats(delivered)},
            streams=pack_parts(streams, SourceStream.STATE_DEPTHS),
            batchers=pack_parts(batchers, Bucketer.STATE_DEPTHS),
        )


def _locations(shards: Sequence[int], n: int, salt: int, seed: int) -> np.ndarray:
    """``n`` distinct (shard, byte offset) locations in ``shards``, in random order (a shuffle buffer
    holds them in the order of its draws): samples of 1-100 tar blocks one after the other, every
    other one kept (``salt`` 0 or 1: the stream's buffer and its buckets hold different samples)."""
    rng = np.random.default_rng([seed, salt, n])
    j = np.arange(n, dtype=np.int64)
    rows = np.empty((n, 2), dtype=np.int64)
    rows[:, 0] = np.asarray(shards, dtype=np.int64)[j % len(shards)]
    blocks = np.cumsum(rng.integers(1, 101, size=2 * n + 2))
    rows[:, 1] = 512 * blocks[2 * (j // len(shards)) + salt]
    return rows[rng.permutation(n)]


def _bucketer_state(items: np.ndarray, emitted: int) -> dict[str, Any]:
    """A bucketer holding ``items`` in three of its buckets (its state's shape, as it saves it)."""
    m = len(items)
    counts = [m // 3, m // 3, m - 2 * (m // 3)]
    buckets = [[b, emitted - 1 - b, c] for b, c in zip((2, 3, 4), counts) if c]
    return {
        "buckets": buckets,
        "items": items.tolist(),
        "ready": [],
        "emitted": emitted,
        "waiting": [[o, b] for b, o, _ in buckets],
    }


class Files(Sequence[dict[str, Any]]):
    """The saved ranks' states as files: ``states[r]`` parses rank ``r``'s JSON text (built once, when
    first asked for), counting the bytes and the ranks read."""

    def __init__(self, old: OldWorld, texts: dict[int, str]) -> None:
        self.old, self.texts = old, texts
        self.bytes = 0
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.old.ranks

    def __getitem__(self, r: Any) -> Any:
        if not isinstance(r, int):
            raise TypeError("a rank")
        if r not in self.texts:
            self.texts[r] = self.old.text(r)
        text = self.texts[r]
        self.bytes += len(text)
        self.read.append(r)
        return json.loads(text)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[r] for r in range(len(self)))


# ---- measuring -----------------------------------------------------------------------------------


def old_ranks_for(old: OldWorld, world: int, workers: int, rank: int) -> range:
    """The old ranks whose states new rank ``rank`` (of ``world`` x ``workers``) reads."""
    from mixer.mixing.leftover import Split

    ks = Split(old.readers, world * workers, workers).readers_of(rank)
    return range(ks.start // old.workers, (ks.stop - 1) // old.workers + 1)


def worst_ratios(old: OldWorld, world: int, workers: int) -> tuple[float, float]:
    """Over every new rank of ``world`` x ``workers`` (from the split, exactly): the most it reads
    against its share, when each old rank's state is one object (a file per rank) and when each old
    reader's is (a storage that reads a rank's readers one by one), all old ranks and readers alike."""
    from mixer.mixing.leftover import Split

    split = Split(old.readers, world * workers, workers)
    files = max(len(old_ranks_for(old, world, workers, r)) for r in range(world))
    readers = max(len(split.readers_of(r)) for r in range(world))
    return files * world / old.ranks, readers * world / old.readers


def load(
    mix: Any, old: OldWorld, texts: dict[int, str], world: int, workers: int, rank: int, *, trace: bool
) -> dict[str, Any]:
    """One new rank's ``Loader.load_state_dict`` over the old world's files (the agreement simulated)."""
    import mixer
    from mixer.runtime import loader as loader_module

    agreed = old.agreed()

    def agree(local: np.ndarray) -> np.ndarray:
        if not (local <= agreed).all():
            raise AssertionError("a rank's own integers exceed the whole run's")
        return np.maximum(local, agreed)

    loader = mixer.make_loader(at_rank(mix, rank, world), num_workers=workers, multiprocessing_context="spawn")
    files = Files(old, texts)
    with mock.patch.object(loader_module, "max_over_ranks", lambda *a, **k: agree):
        if trace:
            tracemalloc.start()
        t0, c0 = time.perf_counter(), time.process_time()
        loader.load_state_dict(files)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak = tracemalloc.get_traced_memory()[1] if trace else None
        if trace:
            tracemalloc.stop()
    state = loader.state_dict()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_mb": None if peak is None else peak / 2**20,
        "files": files,
        "state_bytes": len(json.dumps(state, separators=(",", ":"))),
    }


def old_path_bound(mix: Any, old: OldWorld, texts: dict[int, str], samples: int = 3) -> float:
    """Seconds of the old path's first step for one new rank: unpacking every old reader's snapshot
    (``unpack_snapshot`` timed on ``samples`` old readers, times the old readers)."""
    from mixer.plan.world import World
    from mixer.state import checkpoint

    state = json.loads(texts[min(texts)])
    template = mix.reader(World(rank=state["rank"], world_size=old.ranks, worker=0, num_workers=old.workers))
    times = []
    for reader in state["readers"][:samples]:
        t0 = time.process_time()
        checkpoint.unpack_snapshot(reader["snapshot"], streams=template.streams, batchers=template.batchers)
        times.append(time.process_time() - t0)
    return statistics.median(times) * old.readers


def simulate(scale: Scale, log: Callable[[str], None] = lambda m: None) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    mix = build_mixture(scale)
    shards = sum(len(s.shards) for s in mix.listed)
    log(f"{scale.sources} sources, {shards} shards listed in {time.perf_counter() - t0:.1f} s")
    rows = []
    for ranks in scale.worlds:
        old = OldWorld(mix, ranks, scale.workers)
        texts: dict[int, str] = {}
        for label, world, workers in shapes(ranks, scale.workers):
            worst = worst_ratios(old, world, workers)
            for rank in sorted({0, world // 2})[-scale.timed :]:
                for r in old_ranks_for(old, world, workers, rank):  # built before the clock starts
                    if r not in texts:
                        texts[r] = old.text(r)
                timed = load(mix, old, texts, world, workers, rank, trace=False)
                peak = load(mix, old, texts, world, workers, rank, trace=True)["peak_mb"]
                files = timed["files"]
                per_rank = statistics.mean(len(t) for t in texts.values())
                share = per_rank * ranks / world
                rows.append(
                    {
                        "section": "elastic",
                        "sources": scale.sources,
                        "shards": shards,
                        "old": f"{ranks}x{scale.workers}",
                        "new": f"{world}x{workers}",
                        "shape": label,
                        "rank": rank,
                        "load_s": timed["wall_s"],
                        "load_cpu_s": timed["cpu_s"],
                        "peak_mb": peak,
                        "old_ranks_read": len(set(files.read)),
                        "read_mb": files.bytes / 2**20,
                        "share_mb": share / 2**20,
                        "read_ratio": files.bytes / share,
                        "worst_files_ratio": worst[0],
                        "worst_readers_ratio": worst[1],
                        "old_state_mb_per_rank": per_rank / 2**20,
                        "new_state_mb": timed["state_bytes"] / 2**20,
                    }
                )
                r_ = rows[-1]
                log(
                    f"{r_['old']} -> {r_['new']} rank {rank}: {r_['load_s']:.2f} s ({r_['load_cpu_s']:.2f} CPU), "
                    f"peak {peak:.1f} MB, read {r_['old_ranks_read']} old ranks, {r_['read_ratio']:.2f}x its share"
                )
        bound = old_path_bound(mix, old, texts)
        rows.append(
            {
                "section": "elastic",
                "sources": scale.sources,
                "shards": shards,
                "old": f"{ranks}x{scale.workers}",
                "new": "any",
                "shape": "old path (lower bound)",
                "rank": None,
                "load_s": None,
                "load_cpu_s": bound,
                "peak_mb": None,
                "old_ranks_read": ranks,
                "read_mb": per_rank * ranks / 2**20,
                "share_mb": None,
                "read_ratio": None,
                "worst_files_ratio": None,
                "worst_readers_ratio": None,
                "old_state_mb_per_rank": per_rank / 2**20,
                "new_state_mb": None,
            }
        )
        log(f"{ranks}x{scale.workers}: the old path unpacks every snapshot: >= {bound:.1f} CPU-s per new rank")
    return rows


def agreement_check(scale: Scale) -> dict[str, Any]:
    """At a tiny world: every new rank's state with the agreement simulated equals the state it computes
    reading every saved state (``agree=None``)."""
    from mixer.mixing import elastic

    mix = build_mixture(scale)
    old = OldWorld(mix, 4, 2)
    states = [old.state(r) for r in range(old.ranks)]
    same = True
    for rank in range(3):
        new = at_rank(mix, rank, 3)
        agreed = elastic.resume_state(new, Files(old, {}), num_workers=2, agree=lambda v: np.maximum(v, old.agreed()))
        alone = elastic.resume_state(new, states, num_workers=2, agree=None)
        same = same and json.dumps(agreed, sort_keys=True) == json.dumps(alone, sort_keys=True)
    return {"section": "elastic", "check": "simulated all_reduce == reading every state (4x2 -> 3x2)", "ok": same}


def run(profile: str, log: Callable[[str], None] = lambda m: None) -> list[dict[str, Any]]:
    """The rows of the module docstring (``quick`` and ``smoke``: a small scale, and the agreement check)."""
    scales = SCALES[profile]
    rows = [row for scale in scales for row in simulate(scale, log)]
    if profile != "full":
        rows.append(agreement_check(scales[0]))
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    from .common import markdown_table

    def f(x: Any, spec: str) -> str:
        return "—" if x is None else format(x, spec)

    body = [
        [
            f"{r['old']} -> {r['new']}",
            r["shape"],
            str(r["sources"]),
            "—" if r["rank"] is None else str(r["rank"]),
            f(r["load_s"], ".3f"),
            f(r["load_cpu_s"], ".3f"),
            f(r["peak_mb"], ".1f"),
            str(r["old_ranks_read"]),
            f(r["read_mb"], ".2f"),
            f(r["read_ratio"], ".2f"),
            f(r["worst_files_ratio"], ".2f"),
            f(r["worst_readers_ratio"], ".2f"),
            f(r["old_state_mb_per_rank"], ".2f"),
        ]
        for r in rows
        if "check" not in r
    ]
    header = ["old -> new", "shape", "sources", "new rank", "load s", "CPU s", "peak MB", "old ranks read"]
    header += ["MB read", "x own share", "worst rank: x share, file per rank", "per reader", "MB per old rank"]
    checks = [f"{r['check']}: {'yes' if r['ok'] else 'NO'}" for r in rows if "check" in r]
    return markdown_table(header, body) + ("\n\n" + "\n".join(checks) if checks else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.world_scale_elastic", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    opts = p.parse_args(argv)
    rows = run(
        "quick" if opts.quick else "full",
        lambda m: print(f"[{NAME} {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True),
    )
    print(table(rows))
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
