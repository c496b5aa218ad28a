"""Scratch benchmark: CPU-µs per sample of the padded collate (`mixer.collate.collate`), its compiled
row copies (`mixer._rows`) against the numpy ones, on batches shaped like the loader's.

    python -m benchmarks.collate_speed [--samples 200000] [--rounds 5] [--quick]

Samples of lognormal length (median 300, sigma 0.6, as the benchmark shards), each its own int32
array (as a decode makes them), are bucketed by power-of-two edges and cut into batches of at most
``--max-tokens`` padded tokens (65,536: ~120 rows of ~300 tokens at the 512 edge), as a
``TokenBudget`` bucketer cuts them. Then alternates, per round, over all batches:

* ``compiled``: ``collate(...)`` with the compiled row copies (a new buffer per batch);
* ``python``: the same with ``native=False``;
* ``compiled-slot`` / ``python-slot``: the same writing into one reused buffer (``out=``, as a
  worker writes into its shared slot).

The tokens of all batches (~240 MB at the default size) are far beyond the caches, so each copy reads
them from memory as the loader's collate does. Each method's output is checked against
``python``'s on every batch first. Times are CPU time of this process
(`time.process_time`), best round of each, per sample.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from mixer import collate as collate_mod
from mixer.collate import collate


def make_batches(samples: int, max_tokens: int, seed: int = 0) -> list[tuple[list[np.ndarray], np.ndarray, np.ndarray, list[str]]]:
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
                ([arrays[i] for i in part.tolist()], lengths[part].astype(np.int64), rng.integers(0, 3, len(part)), [f"s{i}" for i in part.tolist()])
            )
    order = rng.permutation(len(batches))  # buckets release interleaved
    return [batches[i] for i in order.tolist()]


def run(batches: list, *, native: bool, slot: np.ndarray | None) -> list:
    out = (lambda n: slot[:n]) if slot is not None else None
    return [collate(a, lens, src, keys, native=native, out=out) for a, lens, src, keys in batches]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.collate_speed", description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--max-tokens", type=int, default=65_536)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="20k samples, 2 rounds")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.samples, opts.rounds = 20_000, 2
    if not collate_mod.NATIVE:
        raise SystemExit("mixer._rows was not built: nothing compiled to compare (python setup.py build_ext --inplace)")
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
            got = run([(a, lens, src, keys)], **kw)[0].buffer
            assert torch.equal(got, want), "compiled and numpy collates differ"
    best: dict[str, float] = {}
    for _ in range(opts.rounds):
        for name, kw in methods.items():
            t0 = time.process_time()
            got = run(batches, **kw)
            best[name] = min(best.get(name, float("inf")), time.process_time() - t0)
            del got
    print(f"{len(batches)} batches, {n} samples, rows per batch median {int(np.median(rows))} (max {rows.max()})")
    print("| method | CPU-µs/sample (best of %d) |" % opts.rounds)
    print("|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t / n * 1e6:.3f} |")
    print(f"compiled / python: {best['compiled'] / best['python']:.2f}; slot: {best['compiled-slot'] / best['python-slot']:.2f}")


if __name__ == "__main__":
    main()
