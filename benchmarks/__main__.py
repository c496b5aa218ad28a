"""`python -m benchmarks [name ...] [--quick]`: run the suite, print one Markdown table (stdout).

Progress goes to stderr; each benchmark writes `<bench-dir>/<name>.json` (`<name>.quick.json` with
`--quick`). Exit status 1 when a method failed (a method whose mixer piece is not importable yet is
skipped with a note, not failed).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from . import BENCHMARKS, common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument(
        "names", nargs="*", metavar="name", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})"
    )
    p.add_argument("--quick", action="store_true", help="small shard set, 1 round: a smoke run (< 30 s)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; 1 with --quick)")
    p.add_argument(
        "--bench-dir",
        type=Path,
        default=common.DEFAULT_BENCH_DIR,
        help="shard cache and JSON results (default .bench/)",
    )
    p.add_argument(
        "--decode",
        choices=sorted(common.DECODERS),
        default="frombuffer",
        help="tokens.npy decode for the webdataset baselines",
    )
    p.add_argument(
        "--methods",
        type=lambda s: [m for m in s.split(",") if m],
        default=None,
        help="throughput: comma-separated subset of raw,wds,randommix,randommix_tokprobs,mixer_reader,mixer,"
        "mixer_all_exhausted,"
        "torchdata,torchdata_tokprobs,mixer_w1,mixer_w2",
    )
    p.add_argument(
        "--budget", type=float, default=1.0, help="mixing methods stop after this many times the shard set's tokens"
    )
    p.add_argument(
        "--window-tokens",
        type=int,
        default=None,
        help="window for the windowed share error (default 8Mi tokens; 512Ki with --quick)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads in this process (default 1, as in a DataLoader worker: on a small shared "
        "machine extra OpenMP threads spin and inflate CPU time without helping the collates)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    opts = p.parse_args(argv)
    unknown = [n for n in opts.names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    opts.names = opts.names or list(BENCHMARKS)
    opts.profile = "quick" if opts.quick else "full"
    if opts.rounds is None:
        opts.rounds = 1 if opts.quick else 3
    if opts.window_tokens is None:
        opts.window_tokens = 1 << 19 if opts.quick else 1 << 23
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    import torch

    torch.set_num_threads(opts.torch_threads)

    def log(msg: str) -> None:
        if not opts.quiet:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    machine = common.machine_info()
    machine["torch_threads"] = opts.torch_threads
    log(f"{machine['platform']}, {machine['cpus']} CPUs, load {machine['loadavg']}")
    results = []
    for name in opts.names:
        module = importlib.import_module(f"benchmarks.{name}")
        log(f"== {name} ({opts.profile}, {opts.rounds} round(s))")
        t0 = time.perf_counter()
        result = module.run(opts, log)
        result.config["machine"] = machine
        result.config["load_after"] = os.getloadavg()
        result.config["seconds"] = time.perf_counter() - t0
        suffix = ".quick.json" if opts.quick else ".json"
        common.write_json(result, opts.bench_dir / f"{name}{suffix}")
        results.append(result)

    print(common.rows_table(results))
    print()
    print(common.checks_table(results))
    print()
    shards = {r.config.get("shards") for r in results}
    print(
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs, Python {machine['python']}, "
        f"torch {machine['torch']}, webdataset {machine['webdataset']}, torch threads {opts.torch_threads}; "
        f"load average before {tuple(round(x, 2) for x in machine['loadavg'])}, "
        f"after {tuple(round(x, 2) for x in os.getloadavg())}."
    )
    for s in sorted(x for x in shards if x):
        print(f"Shards: {s}.")
    print(
        f"Rates are medians over {opts.rounds} alternating round(s); ratios are medians of per-round ratios; "
        "CPU is process + waited-for children (getrusage)."
    )
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
