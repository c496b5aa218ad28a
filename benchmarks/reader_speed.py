"""Scratch benchmark: CPU-µs per sample of mixer's tar reader, compiled and pure Python, against the
raw byte read of the same shards and against webdataset, on small token samples.

    python -m benchmarks.reader_speed [--samples 50000] [--shards 10] [--rounds 3] [--quick]

Writes ~50k samples (lengths lognormal around 300, ``tokens.npy`` int32) twice: with an integer
mtime (no PAX headers, the benchmark suite's shards) and with webdataset.ShardWriter's default
float mtime (a PAX header before every member: the shards users have). Then alternates, per round
and shard set:

* ``raw``: the files read with ``readinto`` into one buffer: the floor for reading those bytes;
* ``compiled``: `mixer.read.tario.read_samples` + `mixer.read.decode.default_tokens` (the compiled core);
* ``python``: the same with ``native=False`` (the pure-Python reader and decode, as before the core);
* ``compiled-read`` / ``python-read``: the same two without token decoding;
* ``wds``: ``webdataset.WebDataset(urls, shardshuffle=False)`` + ``np.load`` of ``tokens.npy``
  (left out with ``--quick``).

Every reader keeps a running token (or byte) count and is checked against the others, so none can
skip work. Times are CPU time of this process (`time.process_time`: user + system, so the page-cache
copies count), best round of each; the summary gives µs/sample and the ratio to ``raw``.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np
import webdataset as wds

from mixer.read import tario
from mixer.read.decode import default_tokens
from mixer.read.tario import read_samples


def write_shards(folder: str, samples: int, shards: int, *, pax: bool, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(300), 0.6, samples).astype(int), 1, 8192)
    per_shard = -(-samples // shards)
    os.makedirs(folder)
    pattern = os.path.join(folder, "bench-%06d.tar")
    kw = {} if pax else {"mtime": 1_700_000_000}
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0, **kw) as writer:
        for i, n in enumerate(lengths):
            writer.write({"__key__": f"s{i:08d}", "tokens.npy": rng.integers(1, 30000, n, dtype=np.int32)})
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar"))


def run_raw(urls: list[str]) -> tuple[int, int]:
    buf = bytearray(1 << 20)
    total = 0
    for url in urls:
        with open(url, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return -1, total  # samples: the shard set's count (raw reading does not see them)


def _mixer(native: bool, decode: bool) -> Callable[[list[str]], tuple[int, int]]:
    def run(urls: list[str]) -> tuple[int, int]:
        count = total = 0
        for url in urls:
            with open(url, "rb") as stream:
                for sample in read_samples(stream, url=url, native=native):
                    if decode:
                        total += len(default_tokens(sample, native=native))
                    else:
                        total += len(sample["tokens.npy"])
                    count += 1
        return count, total

    return run


def run_wds(urls: list[str]) -> tuple[int, int]:
    count = tokens = 0
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        tokens += len(np.load(io.BytesIO(sample["tokens.npy"])))
        count += 1
    return count, tokens


def contenders(quick: bool) -> dict[str, Callable[[list[str]], tuple[int, int]]]:
    found = {"raw": run_raw}
    if tario.NATIVE:
        found |= {"compiled": _mixer(True, True), "compiled-read": _mixer(True, False)}
    found |= {"python": _mixer(False, True), "python-read": _mixer(False, False)}
    if not quick:
        found["wds"] = run_wds
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="10k samples, 1 round, no webdataset")
    opts = parser.parse_args()
    if opts.quick:
        opts.samples, opts.rounds = min(opts.samples, 10_000), 1
    if not tario.NATIVE:
        print("mixer._native._tarwalk is not built: the compiled rows are missing")
    runs = contenders(opts.quick)
    with tempfile.TemporaryDirectory(prefix="reader_speed-") as folder:
        sets = {
            name: write_shards(os.path.join(folder, name), opts.samples, opts.shards, pax=name == "pax")
            for name in ("int-mtime", "pax")
        }
        for name, urls in sets.items():
            megabytes = sum(os.path.getsize(u) for u in urls) / 1e6
            print(f"{name}: {opts.samples} samples in {len(urls)} shards ({megabytes:.1f} MB)")
        best = {(s, c): float("inf") for s in sets for c in runs}
        expected: dict[tuple[str, bool], tuple[int, int]] = {}
        for r in range(opts.rounds):
            for set_name, urls in sets.items():
                for name, fn in runs.items():
                    start = time.process_time()
                    count, total = fn(urls)
                    seconds = time.process_time() - start
                    if name != "raw":
                        check = expected.setdefault((set_name, name.endswith("-read")), (count, total))
                        assert (count, total) == check, f"{name} read {(count, total)} on {set_name}, expected {check}"
                    us = 1e6 * seconds / opts.samples
                    best[set_name, name] = min(best[set_name, name], us)
                    print(f"round {r} {set_name:9s} {name:14s} {us:6.2f} CPU-µs/sample")
        print("\nbest round, CPU-µs/sample (x raw):")
        print(f"| shards | {' | '.join(runs)} |")
        print(f"|---|{'---|' * len(runs)}")
        for set_name in sets:
            raw = best[set_name, "raw"]
            cells = [f"{best[set_name, c]:.2f} ({best[set_name, c] / raw:.1f}x)" for c in runs]
            print(f"| {set_name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
