"""How a reader's buffer budget (``Mixture(buffer_budget=...)``) moves batch quality, at many
sources: padding efficiency, batch fill, realized token shares, samples held, state size (what it
costs in memory as samples grow longer: ``buffer_memory``).

The sources of ``many_sources`` (2 shards x 120 samples each, lognormal lengths, median 200 tokens),
``N`` of them (1,000; ``--quick``: 200) at Zipf shares (``1 / (1 + i)``: a few common sources and a
long tail, as language or domain partitions are), ``TokenBudget(65536)`` (``--max-tokens``: each
source holds about one such batch of tokens in all, so smaller budgets show more), one reader in this process
(no workers: the figures are the reader's own), ``BATCHES`` batches, for each ``mix`` ("batch": one
source per batch, a batcher per source; "sample": buckets shared by all sources) and each budget
(in tokens, the default among them, and the old default in samples):

* padding efficiency: real tokens / padded slots (``B * L`` of each batch);
* batch fill: real tokens per batch / ``max_tokens`` (what a small allotment costs ``mix="batch"``);
* share error: total variation between the realized token shares and the targets;
* held: the most samples the reader held in shuffle buffers and buckets (counted after every batch);
* the reader's state size (JSON) at the end, and CPU seconds per batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import common
from .many_sources import MAX_TOKENS, _pattern, ensure_sources

NAME = "buffer_budget"
SOURCES = {"full": 1000, "quick": 200}
BATCHES = {"full": 300, "quick": 100}
BUDGETS: tuple[str | None, ...] = (None, "65536 samples", "32M tokens", "8M tokens", "2M tokens")


def _held(reader: Any) -> int:
    batchers = {id(b): b for b in reader.batchers}.values()
    return sum(len(st.buffer) for st in reader.streams) + sum(b.count + sum(map(len, b.ready)) for b in batchers)


def measure(n: int, root: Path, mix: str, budget: str | None, batches: int, max_tokens: int) -> dict[str, Any]:
    import mixer
    from mixer.plan.world import World

    shares = 1.0 / (1.0 + np.arange(n))
    sources = [mixer.Source(f"s{i:04d}", str(root) + "/" + _pattern(i), weight=float(shares[i])) for i in range(n)]
    m = mixer.Mixture(sources, batching=mixer.TokenBudget(max_tokens), seed=0, mix=mix, buffer_budget=budget)  # type: ignore[arg-type]
    reader = m.reader(World())
    real = padded = 0
    per_source = np.zeros(n)
    held = 0
    t0 = time.process_time()
    for k, batch in enumerate(reader, 1):
        lengths = batch.lengths.numpy()
        real += int(lengths.sum())
        padded += int(batch.tokens.numel())
        np.add.at(per_source, batch.source.numpy(), lengths)
        held = max(held, _held(reader))
        if k >= batches:
            break
    cpu = time.process_time() - t0
    state = json.dumps(reader.state_dict())
    target = shares / shares.sum()
    return {
        "sources": n,
        "mix": mix,
        "budget": budget,
        "batches": k,
        "padding_efficiency": real / padded,
        "batch_fill": real / (k * max_tokens),
        "share_tv": 0.5 * float(np.abs(per_source / per_source.sum() - target).sum()),
        "held_max": held,
        "state_bytes": len(state),
        "cpu_ms_per_batch": 1e3 * cpu / k,
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "mix",
        "buffer_budget",
        "padding eff.",
        "batch fill",
        "share error (TV)",
        "most held",
        "reader state",
        "CPU ms/batch",
    ]
    body = [
        [
            r["mix"],
            "None" if r["budget"] is None else str(r["budget"]),
            f"{r['padding_efficiency']:.3f}",
            f"{r['batch_fill']:.2f}",
            f"{r['share_tv']:.3f}",
            f"{r['held_max']:,}",
            f"{r['state_bytes'] / 1e3:.1f} kB",
            f"{r['cpu_ms_per_batch']:.1f}",
        ]
        for r in rows
    ]
    return common.markdown_table(header, body)


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    n = getattr(opts, "sources", None) or SOURCES[opts.profile]
    batches = getattr(opts, "batches", None) or BATCHES[opts.profile]
    root, _ = ensure_sources(n, opts.bench_dir, log)
    rows = []
    for mix in ("batch", "sample"):
        for budget in BUDGETS:
            r = measure(n, root, mix, budget, batches, getattr(opts, "max_tokens", MAX_TOKENS))
            log(f"mix={mix} budget={budget}: {r}")
            rows.append(r)
    text = table(rows)
    log("\n" + text)
    checks = [
        common.value_check(
            NAME, f"padding efficiency, mix={r['mix']}, budget={r['budget']}", r["padding_efficiency"], 0.95, ">="
        )
        for r in rows
    ]
    result_rows = [
        {
            "bench": NAME,
            "method": f"{r['mix']}/{r['budget']}",
            "label": f"mix={r['mix']} budget={r['budget']}",
            "kind": "scale",
            "status": "ok",
            "note": "",
            **r,
        }
        for r in rows
    ]
    return common.BenchResult(
        NAME,
        result_rows,
        checks,
        {
            "profile": opts.profile,
            "sources": n,
            "batches": batches,
            "max_tokens": getattr(opts, "max_tokens", MAX_TOKENS),
            "table": text,
        },
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.buffer_budget", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sources", type=int, default=None)
    p.add_argument("--batches", type=int, default=None)
    p.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help="TokenBudget(max_tokens) (default: many_sources')"
    )
    p.add_argument("--bench-dir", type=Path, default=common.DEFAULT_BENCH_DIR)
    return common.standalone(NAME, p, run, argv, tables=("table",))


if __name__ == "__main__":
    sys.exit(main())
