"""Scratch benchmark: samples/s of mixer's tar reader vs webdataset on small token samples.

    python -m benchmarks.reader_speed [--samples 50000] [--shards 10] [--rounds 3]

Writes ~50k samples (lengths lognormal around 300, ``tokens.npy`` int32, integer mtime so there are
no PAX headers) into shards in a temporary folder, then alternates, per round:

* ``mixer``: `mixer.tario.read_samples` + `mixer.decode.default_tokens` over every shard;
* ``wds``: ``webdataset.WebDataset(urls, shardshuffle=False)`` (no ``.decode()``) +
  ``np.load(io.BytesIO(sample["tokens.npy"]))``;
* ``mixer-read`` / ``wds-read``: the same two readers without token decoding.

Both keep a running token count so neither can skip work. Prints samples/s for each and the ratio
(best round of each, so a noisy neighbour cannot flatter either side).
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

from mixer.decode import default_tokens
from mixer.tario import read_samples


def write_shards(folder: str, samples: int, shards: int, *, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(300), 0.6, samples).astype(int), 1, 8192)
    per_shard = -(-samples // shards)
    pattern = os.path.join(folder, "bench-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0, mtime=1_700_000_000) as writer:
        for i, n in enumerate(lengths):
            writer.write({"__key__": f"s{i:08d}", "tokens.npy": rng.integers(1, 30000, n, dtype=np.int32)})
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar"))


def run_mixer(urls: list[str]) -> tuple[int, int]:
    count = tokens = 0
    for url in urls:
        with open(url, "rb") as stream:
            for sample in read_samples(stream, url=url):
                tokens += len(default_tokens(sample))
                count += 1
    return count, tokens


def run_wds(urls: list[str]) -> tuple[int, int]:
    count = tokens = 0
    for sample in wds.WebDataset(urls, shardshuffle=False):
        tokens += len(np.load(io.BytesIO(sample["tokens.npy"])))
        count += 1
    return count, tokens


# Reading alone (no token decoding), for the record: how much of the gap is the tar layer.
def run_mixer_read(urls: list[str]) -> tuple[int, int]:
    count = nbytes = 0
    for url in urls:
        with open(url, "rb") as stream:
            for sample in read_samples(stream, url=url):
                nbytes += len(sample["tokens.npy"])
                count += 1
    return count, nbytes


def run_wds_read(urls: list[str]) -> tuple[int, int]:
    count = nbytes = 0
    for sample in wds.WebDataset(urls, shardshuffle=False):
        nbytes += len(sample["tokens.npy"])
        count += 1
    return count, nbytes


CONTENDERS = {"mixer": run_mixer, "wds": run_wds, "mixer-read": run_mixer_read, "wds-read": run_wds_read}


def timed(fn: Callable[[list[str]], tuple[int, int]], urls: list[str]) -> tuple[float, int, int]:
    start = time.perf_counter()
    count, tokens = fn(urls)
    return time.perf_counter() - start, count, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="reader_speed-") as folder:
        urls = write_shards(folder, opts.samples, opts.shards)
        megabytes = sum(os.path.getsize(u) for u in urls) / 1e6
        print(f"{opts.samples} samples in {len(urls)} shards ({megabytes:.1f} MB) in {folder}")
        best = dict.fromkeys(CONTENDERS, 0.0)
        expected: dict[str, tuple[int, int]] = {}
        for r in range(opts.rounds):
            for name, fn in CONTENDERS.items():
                seconds, count, total = timed(fn, urls)
                kind = "tokens" if name in ("mixer", "wds") else "bytes"
                expected.setdefault(kind, (count, total))
                assert (count, total) == expected[kind], f"{name} read {(count, total)}, expected {expected[kind]}"
                rate = count / seconds
                best[name] = max(best[name], rate)
                print(f"round {r}: {name:10s} {rate:10,.0f} samples/s  ({1e6 / rate:5.1f} µs/sample)")
        print(
            f"best: mixer {best['mixer']:,.0f} samples/s, wds {best['wds']:,.0f} samples/s, "
            f"ratio {best['mixer'] / best['wds']:.1f}x  (reading only: {best['mixer-read'] / best['wds-read']:.1f}x)"
        )

if __name__ == "__main__":
    main()
