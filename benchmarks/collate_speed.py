"""Scratch benchmark: CPU-µs per sample of the padded and packed collates (`mixer.batching.collate`), their
compiled copies (`mixer._native._rows`) against the numpy ones, on batches shaped like the loader's.

    python -m benchmarks.collate_speed [--samples 200000] [--rounds 5] [--quick]
    python -m benchmarks.collate_speed --captured 700 [--loop]
    python -m benchmarks.collate_speed --packed [--samples 200000]

Samples of lognormal length (median 300, sigma 0.6, as the benchmark shards), each its own int32
array (as a decode makes them), are bucketed by power-of-two edges and cut into batches of at most
``--max-tokens`` padded tokens (65,536: ~120 rows of ~300 tokens at the 512 edge), as a
``TokenBudget`` bucketer cuts them. Then alternates, per round, over all batches:

* ``compiled``: ``collate(...)`` with the compiled row copies (a new buffer per batch);
* ``python``: the same with ``native=False``;
* ``compiled-slot`` / ``python-slot``: the same writing into one reused buffer (``out=``, as a
  worker writes into its shared slot).

With ``--captured N`` the batches are instead the first N the throughput benchmark's mixture makes
over its shards (`python -m benchmarks throughput` writes them; 0 workers), captured at the layout,
and each method is the layout's whole ``collate`` (its per-sample getters included). ``--loop``
adds whole-loop runs over those N batches, alternating ``mixer.batching.collate.NATIVE`` on and off
(CPU-µs/sample of everything; the difference is the collate's share, within this machine's noise).

With ``--packed`` the same samples are placed by the real ``Packer`` instead, for the three
packings of ``benchmarks/layouts.py`` (rows of 8192 with splits, rows of 32768 whole, flat), and each
method is ``PackedLayout.collate`` (tokens, positions, boundaries), compiled and numpy.

The tokens of all batches (~240 MB at the default size) are far beyond the caches, so each copy reads
them from memory as the loader's collate does. Each method's output is checked against
``python``'s on every batch first. Times are CPU time of this process
(`time.process_time`), best round of each, per sample.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixer.batching import collate as collate_mod
from mixer.batching.batch import BatchMeta
from mixer.batching.collate import collate


def make_batches(
    samples: int, max_tokens: int, seed: int = 0
) -> list[tuple[list[np.ndarray], np.ndarray, np.ndarray, list[str]]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(300), 0.6, samples).astype(int), 1, max_tokens)
    edges = 1 << np.ceil(np.log2(lengths)).astype(int)
    arrays = [rng.integers(1, 30000, n, dtype=np.int32) for n in lengths.tolist()]
    batches = []
    for edge in np.unique(edges).tolist():
        idx = np.flatnonzero(edges == edge)
        cap = max(1, max_tokens // edge)
        for a in range(0, len(idx), cap):
            part = idx[a : a + cap]
            batches.append(
                (
                    [arrays[i] for i in part.tolist()],
                    lengths[part].astype(np.int64),
                    rng.integers(0, 3, len(part)),
                    [f"s{i}" for i in part.tolist()],
                )
            )
    order = rng.permutation(len(batches))  # buckets release interleaved
    return [batches[i] for i in order.tolist()]


def capture(bench_dir: Path, count: int) -> tuple[Any, list[tuple[list[Any], np.ndarray]]]:
    """The first ``count`` batches of the throughput benchmark's mixture, as its layout got them."""
    from . import common, throughput

    mixture = throughput.make_mixture(common.ensure_shards("full", bench_dir))
    layout, got = mixture.layout, []
    collate_batch = layout.collate

    def record(group: Any, sources: np.ndarray, *, meta: Any, out: Any = None) -> Any:
        got.append((list(group), sources.copy()))
        return collate_batch(group, sources, meta=meta, out=out)

    layout.collate = record
    for _ in zip(range(count), mixture):
        pass
    layout.collate = collate_batch
    return layout, got


def loop_cpu(count: int, bench_dir: Path) -> tuple[float, int]:
    from . import common, throughput

    mixture = throughput.make_mixture(common.ensure_shards("full", bench_dir))
    t0, n = time.process_time(), 0
    for batch in itertools.islice(mixture, count):
        n += batch.batch_size
    return time.process_time() - t0, n


def main_packed(opts: argparse.Namespace) -> None:
    import mixer
    from mixer.batching.batchers import Packer
    from mixer.batching.collate import PackedLayout
    from mixer.read.decode import Sample

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 0.6, opts.samples).astype(int), 1, 8192)
    samples = [
        Sample(f"s{i}", rng.integers(1, 30000, n, dtype=np.int32), n, 0, i) for i, n in enumerate(lengths.tolist())
    ]
    meta = BatchMeta()
    print(f"{opts.samples} documents; CPU-µs/document, best of {opts.rounds}")
    print("| packing | compiled | numpy | compiled / numpy |")
    print("|---|---|---|---|")
    for name, packed in (
        ("rows of 8192, split", mixer.Packed(opts.max_tokens, seq_len=8192, split_documents=True)),
        ("rows of 32768, whole", mixer.Packed(opts.max_tokens, seq_len=32768)),
        ("flat", mixer.Packed(opts.max_tokens)),
    ):
        packer: Packer[Sample] = Packer(packed, locate=lambda s: (0, 0))
        for smp in samples:
            packer.add(smp, smp.length)
        groups = [*packer.ready, *packer.drain()]
        layout = PackedLayout(packed, dtype="int32", pad_id=0)
        sources = [np.zeros(len(g), np.int64) for g in groups]
        for g, src in zip(groups, sources):
            a, b = (layout.collate(g, src, meta=meta, native=x) for x in (True, False))
            assert all(
                torch.equal(getattr(a, f), getattr(b, f))
                for f in ("tokens", "position_ids", "cu_seqlens", "lengths", "offsets")
            )
        best = {True: float("inf"), False: float("inf")}
        for _ in range(opts.rounds):
            for native in best:
                t0 = time.process_time()
                for g, src in zip(groups, sources):
                    layout.collate(g, src, meta=meta, native=native)
                best[native] = min(best[native], time.process_time() - t0)
        c, p = (best[x] / opts.samples * 1e6 for x in (True, False))
        print(f"| {name} | {c:.3f} | {p:.3f} | {c / p:.2f} |")


def main_captured(opts: argparse.Namespace) -> None:
    layout, groups = capture(opts.bench_dir, opts.captured)
    n = sum(len(g) for g, _ in groups)
    rows = np.array([len(g) for g, _ in groups])
    slot = np.empty(layout.max_elements([[layout.budget.max_tokens]]) + 2 * int(rows.max()), dtype=np.int32)
    meta = BatchMeta()
    for g, src in groups:
        a = layout.collate(g, src, meta=meta).buffer
        collate_mod.NATIVE = False
        try:
            assert torch.equal(a, layout.collate(g, src, meta=meta).buffer), "compiled and numpy collates differ"
        finally:
            collate_mod.NATIVE = True
    best: dict[str, float] = {}
    for _ in range(opts.rounds):
        for name in ("compiled", "python", "compiled-slot", "python-slot"):
            collate_mod.NATIVE = not name.startswith("python")
            out = (lambda k: slot[:k]) if name.endswith("slot") else None
            t0 = time.process_time()
            for g, src in groups:  # each batch dropped before the next, as a consumer does
                layout.collate(g, src, meta=meta, out=out)
            best[name] = min(best.get(name, float("inf")), time.process_time() - t0)
    collate_mod.NATIVE = True
    print(
        f"{len(groups)} captured batches, {n} samples, rows per batch median {int(np.median(rows))} (max {rows.max()})"
    )
    report(best, n, opts.rounds)
    if opts.loop:
        loops: dict[str, list[float]] = {"compiled": [], "python": []}
        for _ in range(opts.rounds):
            for name in loops:
                collate_mod.NATIVE = name == "compiled"
                t, k = loop_cpu(opts.captured, opts.bench_dir)
                loops[name].append(t / k * 1e6)
        collate_mod.NATIVE = True
        for name, ts in loops.items():
            print(
                f"whole loop, {name}: CPU-µs/sample per round {', '.join(f'{t:.2f}' for t in ts)} (median "
                f"{np.median(ts):.2f})"
            )


def report(best: dict[str, float], n: int, rounds: int) -> None:
    print(f"| method | CPU-µs/sample (best of {rounds}) |")
    print("|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t / n * 1e6:.3f} |")
    print(
        f"compiled / python: {best['compiled'] / best['python']:.2f}; slot: "
        f"{best['compiled-slot'] / best['python-slot']:.2f}"
    )


def run(batches: list, *, native: bool, slot: np.ndarray | None, keep: bool = False) -> list:
    """Collate every batch; each is dropped before the next (as a consumer does) unless ``keep``."""
    out = (lambda n: slot[:n]) if slot is not None else None
    kept = []
    for a, lens, src, keys in batches:
        b = collate(a, lens, src, keys, native=native, out=out)
        if keep:
            kept.append(b)
    return kept


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.collate_speed", description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--max-tokens", type=int, default=65_536)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="20k samples, 2 rounds")
    p.add_argument(
        "--captured", type=int, default=0, metavar="N", help="the throughput benchmark's first N batches instead"
    )
    p.add_argument("--packed", action="store_true", help="the packed layout's collate instead")
    p.add_argument("--loop", action="store_true", help="with --captured: also whole-loop runs, NATIVE on and off")
    p.add_argument("--bench-dir", type=Path, default=None, help="shard cache (default: the suite's .bench/)")
    opts = p.parse_args(argv)
    if opts.bench_dir is None:
        from .common import DEFAULT_BENCH_DIR

        opts.bench_dir = DEFAULT_BENCH_DIR
    if opts.quick:
        opts.samples, opts.rounds = 20_000, 2
    if not collate_mod.NATIVE:
        raise SystemExit(
            "mixer._native._rows was not built: nothing compiled to compare (python setup.py build_ext --inplace)"
        )
    if opts.captured:
        main_captured(opts)
        return
    if opts.packed:
        main_packed(opts)
        return
    batches = make_batches(opts.samples, opts.max_tokens)
    n = sum(len(b[0]) for b in batches)
    rows = np.array([len(b[0]) for b in batches])
    slot = np.empty(opts.max_tokens + 2 * int(rows.max()), dtype=np.int32)
    methods = {
        "compiled": dict(native=True, slot=None),
        "python": dict(native=False, slot=None),
        "compiled-slot": dict(native=True, slot=slot),
        "python-slot": dict(native=False, slot=slot),
    }
    for a, lens, src, keys in batches:  # every method against python's, batch by batch
        want = collate(a, lens, src, keys, native=False).buffer
        for kw in methods.values():
            got = run([(a, lens, src, keys)], keep=True, **kw)[0].buffer
            assert torch.equal(got, want), "compiled and numpy collates differ"
    best: dict[str, float] = {}
    for _ in range(opts.rounds):
        for name, kw in methods.items():
            t0 = time.process_time()
            run(batches, **kw)
            best[name] = min(best.get(name, float("inf")), time.process_time() - t0)
    print(f"{len(batches)} batches, {n} samples, rows per batch median {int(np.median(rows))} (max {rows.max()})")
    report(best, n, opts.rounds)


if __name__ == "__main__":
    main()
