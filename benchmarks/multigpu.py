"""Does the loader keep the GPUs busy? Each rank streams batches through the device feed while a
synthetic training step of a fixed length runs (issue 7, item 3).

    torchrun --nproc_per_node=N benchmarks/multigpu.py --config demo|CONFIG.yaml --device cuda \\
        --steps 300 --step-ms 200 [--workers 2] [--copy-baseline]
    python -m torch.distributed.run --nproc_per_node=2 benchmarks/multigpu.py --device cpu --steps 20 --step-ms 20

Every rank builds the mixture (its share of the data: rank/world size from torchrun), iterates
`mixer.to_device(make_loader(mixture, num_workers=W, pin_memory=True), device, timing=True)` and, per
step: `next()` on the feed (timed: the *data time* of the step), a kernel that reads the batch's
tokens (so the step truly depends on the copy), then `--step-ms` of work: a calibrated loop of
bf16 matmuls on the GPU, or a sleep with `--device cpu` (a GPU step costs the host no CPU either).
The step ends with a synchronisation, as a loop that logs its loss every step does; so while the
training loop waits in `next()` the GPU has nothing queued: that is a stall. `--device cpu` runs the
same loop under gloo with batches left on the host.

Reported per rank and in total: real (non-pad) tokens/s delivered, H2D GB/s (bytes copied / GPU time
of the feed's copies, from CUDA events), data ms per step (mean, p50, p99, max), stall % (steps whose
data time exceeded `--stall-ms`, default 1 ms) and idle % (total data time / wall time). The first
`--warmup` steps (default 5; they include worker start-up and the first batch, reported separately as
time to first batch) are not counted. `--copy-baseline` (CUDA) also times a plain
`dst.copy_(pinned_src, non_blocking=True)` of the same byte sizes, each copy between two events on an
idle side stream, to compare the feed's H2D rate with (target: >= 80% of it).

Rank 0 prints a Markdown table and writes the JSON (`--json`, default
`.bench/multigpu-<device>-<N>x-<M>ms.json`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script by torchrun: make `benchmarks` and `mixer` importable
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DEMO_WEIGHTS = {"prose": 0.5, "code": 0.3, "books": 0.2}
#: The realistic step time of the GPU check (docs/performance.md): a ~1B-parameter model on one
#: H100/H200-class GPU with a 32-64k-token micro-batch runs 0.2-0.6 s per step; 200 ms is the
#: short end of that.
REALISTIC_STEP_MS = 200.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/multigpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="demo", help="'demo' (built-in demo shards) or a mixer YAML config")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=200, help="measured steps per rank (after --warmup)")
    p.add_argument("--warmup", type=int, default=5, help="steps before measuring (worker start-up, first batch)")
    p.add_argument("--step-ms", type=float, default=REALISTIC_STEP_MS, help="length of the synthetic step")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--prefetch", type=int, default=2, help="batches the device feed copies ahead")
    p.add_argument("--max-tokens", type=int, default=65536, help="token budget per batch (demo)")
    p.add_argument("--stall-ms", type=float, default=1.0, help="a step whose data time exceeds this stalled")
    p.add_argument("--cache-dir", default=None, help="demo shard cache (default ~/.cache/mixer/demo)")
    p.add_argument("--copy-baseline", action="store_true", help="CUDA: also time plain pinned copy_ of the same bytes")
    p.add_argument("--json", type=Path, default=None, help="result file (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summarize", type=Path, nargs="+", metavar="JSON", help="only print the tables of saved results")
    opts = p.parse_args(argv)
    if opts.steps < 1 or opts.warmup < 0 or opts.step_ms < 0:
        p.error("--steps must be >= 1, --warmup and --step-ms >= 0")
    return opts


# --------------------------------------------------------------------------------------------------
# per rank


def build_mixture(opts: argparse.Namespace, rank: int, world: int) -> Any:
    import mixer

    if opts.config != "demo":
        return mixer.load_config(opts.config, rank=rank, world_size=world)
    from mixer.cli.demo import ensure_demo_shards

    if rank == 0:  # generate once; the others reuse the result
        patterns = ensure_demo_shards(opts.cache_dir)
    if world > 1:
        dist.barrier()
    if rank != 0:
        patterns = ensure_demo_shards(opts.cache_dir)
    sources = [mixer.Source(name, patterns[name], weight=w) for name, w in DEMO_WEIGHTS.items()]
    budget = mixer.TokenBudget(max_tokens=opts.max_tokens, max_length=opts.max_tokens)
    return mixer.Mixture(sources, batching=budget, seed=opts.seed, rank=rank, world_size=world)


class Step:
    """The synthetic training step: reads the batch, then `step_ms` of work, then synchronises."""

    def __init__(self, device: torch.device, step_ms: float) -> None:
        self.device = device
        self.step_ms = step_ms
        self.matmuls = 0
        self.matmul_ms = math.nan
        if device.type == "cuda":
            n = 8192  # ~1 ms per matmul on an H100/H200: a 200 ms step is ~200 launches, not thousands
            self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            self.c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
            self.acc = torch.zeros((), device=device, dtype=torch.float64)
            self.matmul_ms = self._calibrate()
            self.matmuls = max(0, round(step_ms / self.matmul_ms))
        else:
            self.acc = torch.zeros((), dtype=torch.float64)

    def _calibrate(self) -> float:
        for _ in range(3):
            torch.mm(self.a, self.b, out=self.c)
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for _ in range(reps):
            torch.mm(self.a, self.b, out=self.c)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    def __call__(self, batch: Any) -> None:
        # Read the batch on the consumer's stream (ordered after its copy by the feed's event).
        self.acc += batch.tokens[:, :1].sum()
        if self.device.type == "cuda":
            for _ in range(self.matmuls):
                torch.mm(self.a, self.b, out=self.c)
            torch.cuda.synchronize(self.device)
        elif self.step_ms > 0:
            time.sleep(self.step_ms / 1e3)


def copy_baseline(sizes: list[int], device: torch.device, reps: int = 3) -> dict[str, float]:
    """Plain pinned `copy_` of the same byte sizes: each copy timed between events on an idle side
    stream (as the feed's copies are), and the whole loop back to back."""
    if not sizes:
        return {}
    biggest = max(sizes)
    src = torch.empty(biggest, dtype=torch.uint8).pin_memory()
    src.fill_(7)
    dst = torch.empty(biggest, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    per_copy_s = 0.0
    with torch.cuda.stream(stream):
        for _ in range(reps):
            events = []
            for n in sizes:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                dst[:n].copy_(src[:n], non_blocking=True)
                b.record(stream)
                events.append((a, b))
            stream.synchronize()
            per_copy_s += sum(a.elapsed_time(b) for a, b in events) / 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            for n in sizes:
                dst[:n].copy_(src[:n], non_blocking=True)
        end.record(stream)
        end.synchronize()
        loop_s = start.elapsed_time(end) / 1e3
    total = reps * sum(sizes)
    return {"per_copy_GBps": total / per_copy_s / 1e9, "loop_GBps": total / loop_s / 1e9}


def run_rank(opts: argparse.Namespace, rank: int, world: int, local_rank: int) -> dict[str, Any]:
    import mixer

    if opts.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    mixture = build_mixture(opts, rank, world)
    step = Step(device, opts.step_ms)
    loader = mixer.make_loader(mixture, num_workers=opts.workers, pin_memory=device.type == "cuda")
    feed = mixer.to_device(loader, device, prefetch=opts.prefetch, timing=device.type == "cuda")

    t_start = time.perf_counter()
    it = iter(feed)
    first_batch_s = math.nan
    data_s: list[float] = []
    tokens = 0
    batch_bytes: list[int] = []
    copies_before = bytes_before = 0
    copy_s_before = 0.0
    t_measure = t_start
    for i in range(opts.warmup + opts.steps):
        if i == opts.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                copy_s_before = feed.copy_seconds
            copies_before, bytes_before = feed.copies, feed.bytes_copied
            t_measure = time.perf_counter()
        t0 = time.perf_counter()
        batch = next(it)
        dt = time.perf_counter() - t0
        if i == 0:
            first_batch_s = time.perf_counter() - t_start
        if i >= opts.warmup:
            data_s.append(dt)
            tokens += batch.meta.tokens
            batch_bytes.append(batch.buffer.numel() * batch.buffer.element_size())
        step(batch)
        del batch
    wall = time.perf_counter() - t_measure
    copies = feed.copies - copies_before
    copy_s = feed.copy_seconds - copy_s_before if device.type == "cuda" else math.nan
    bytes_copied = feed.bytes_copied - bytes_before
    del it
    ms = np.asarray(data_s) * 1e3
    result: dict[str, Any] = {
        "rank": rank,
        "device": str(device),
        "steps": opts.steps,
        "wall_s": wall,
        "first_batch_s": first_batch_s,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "data_ms_mean": float(ms.mean()),
        "data_ms_p50": float(np.percentile(ms, 50)),
        "data_ms_p99": float(np.percentile(ms, 99)),
        "data_ms_max": float(ms.max()),
        "stalled_steps": int((ms > opts.stall_ms).sum()),
        "stall_pct": 100.0 * float((ms > opts.stall_ms).mean()),
        "idle_pct": 100.0 * float(ms.sum() / 1e3 / wall),
        "step_ms_target": opts.step_ms,
        "step_ms_measured": 1e3 * wall / opts.steps,
        "matmuls_per_step": step.matmuls,
        "matmul_ms": step.matmul_ms,
        "copies": copies,
        "bytes_copied": bytes_copied,
        "batch_bytes_mean": float(np.mean(batch_bytes)),
        "h2d_GBps": bytes_copied / copy_s / 1e9 if copy_s and copy_s > 0 else math.nan,
        "h2d_delivered_GBps": bytes_copied / wall / 1e9 if device.type == "cuda" else math.nan,
    }
    if opts.copy_baseline and device.type == "cuda":
        base = copy_baseline(batch_bytes, device)
        result["plain_copy_per_copy_GBps"] = base.get("per_copy_GBps", math.nan)
        result["plain_copy_loop_GBps"] = base.get("loop_GBps", math.nan)
        result["h2d_vs_plain"] = result["h2d_GBps"] / result["plain_copy_per_copy_GBps"]
    return result


# --------------------------------------------------------------------------------------------------
# report (rank 0)


def total_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = sum(r["steps"] for r in rows)
    out: dict[str, Any] = {
        "rank": "total",
        "steps": steps,
        "wall_s": max(r["wall_s"] for r in rows),
        "first_batch_s": max(r["first_batch_s"] for r in rows),
        "tokens": sum(r["tokens"] for r in rows),
        "tokens_per_s": sum(r["tokens_per_s"] for r in rows),
        "data_ms_mean": statistics.fmean(r["data_ms_mean"] for r in rows),
        "data_ms_p50": statistics.median(r["data_ms_p50"] for r in rows),
        "data_ms_p99": max(r["data_ms_p99"] for r in rows),
        "data_ms_max": max(r["data_ms_max"] for r in rows),
        "stalled_steps": sum(r["stalled_steps"] for r in rows),
        "stall_pct": 100.0 * sum(r["stalled_steps"] for r in rows) / steps,
        "idle_pct": statistics.fmean(r["idle_pct"] for r in rows),
        "step_ms_measured": statistics.fmean(r["step_ms_measured"] for r in rows),
        "bytes_copied": sum(r["bytes_copied"] for r in rows),
        "h2d_GBps": statistics.fmean(r["h2d_GBps"] for r in rows),
        "h2d_delivered_GBps": sum(r["h2d_delivered_GBps"] for r in rows),
    }
    for key in ("plain_copy_per_copy_GBps", "plain_copy_loop_GBps", "h2d_vs_plain"):
        if all(key in r for r in rows):
            out[key] = statistics.fmean(r[key] for r in rows)
    return out


def _f(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, spec)


def table(results: list[dict[str, Any]]) -> str:
    """One Markdown table of the rows of one or more results (their JSON payloads)."""
    from benchmarks.common import fmt_si, markdown_table

    header = [
        "device",
        "ranks",
        "workers/rank",
        "step ms (measured)",
        "rank",
        "real tok/s",
        "H2D GB/s",
        "plain copy_ GB/s",
        "data ms/step mean (p99, max)",
        "stall %",
        "idle %",
        "1st batch s",
    ]
    body = []
    for res in results:
        cfg = res["config"]
        for r in res["rows"]:
            body.append(
                [
                    cfg["device"],
                    str(cfg["world_size"]),
                    str(cfg["workers"]),
                    f"{cfg['step_ms']:g} ({r['step_ms_measured']:.1f})",
                    str(r["rank"]),
                    fmt_si(r["tokens_per_s"]),
                    _f(r["h2d_GBps"], ".2f"),
                    _f(r.get("plain_copy_per_copy_GBps"), ".2f"),
                    f"{r['data_ms_mean']:.3f} ({r['data_ms_p99']:.2f}, {r['data_ms_max']:.2f})",
                    f"{r['stall_pct']:.1f} (> {cfg['stall_ms']:g} ms)",
                    f"{r['idle_pct']:.2f}",
                    _f(r["first_batch_s"], ".2f"),
                ]
            )
    return markdown_table(header, body)


def summarize(paths: list[Path]) -> int:
    """Print the tables of saved results together (benchmarks/gpu_check.sh does this at the end)."""
    from benchmarks.common import BenchResult, checks_table

    results = [json.loads(Path(p).read_text()) for p in paths]
    print(table(results))
    print()
    print(checks_table([BenchResult(r["name"], [], r["checks"], {}) for r in results]))
    machines = {json.dumps(r["config"].get("machine", {}).get("gpu")) for r in results}
    for r in results[:1]:
        m = r["config"].get("machine", {})
        print()
        print(
            f"Machine: {m.get('platform')}, {m.get('cpus')} CPUs, GPU {m.get('gpu', '—')}, torch {m.get('torch')}, "
            f"CUDA {m.get('cuda', '—')}."
        )
    if len(machines) > 1:
        print("(results from different machines)")
    return 0


def checks(total: dict[str, Any], opts: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.common import value_check

    name = f"multigpu {opts.device} {opts.step_ms:g} ms"
    realistic = opts.device == "cuda" and opts.step_ms >= REALISTIC_STEP_MS
    out = [
        value_check(name, f"stall % at {opts.step_ms:g} ms steps", total["stall_pct"], 1.0 if realistic else None, "<=")
    ]
    if "h2d_vs_plain" in total:
        out.append(
            value_check(
                name,
                "feed H2D GB/s / plain pinned copy_ GB/s",
                total["h2d_vs_plain"],
                0.8 if opts.device == "cuda" else None,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.summarize:
        return summarize(opts.summarize)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(1)
    distributed = "MASTER_ADDR" in os.environ and world >= 1
    if distributed:
        if opts.device == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if opts.device == "cuda" else "gloo")
    try:
        result = run_rank(opts, rank, world, local_rank)
        rows = [None] * world
        if distributed:
            dist.all_gather_object(rows, result)
        else:
            rows = [result]
    finally:
        if distributed:
            dist.destroy_process_group()
    if rank != 0:
        return 0
    from benchmarks.common import BenchResult, checks_table, machine_info

    rows = sorted(rows, key=lambda r: r["rank"])
    total = total_row(rows)
    shown = rows + [total]
    machine = machine_info()
    if opts.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(0)
        machine["cuda"] = torch.version.cuda
    config = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
        "world_size": world,
        "machine": machine,
    }
    result_checks = checks(total, opts)
    payload = {"name": "multigpu", "config": config, "rows": shown, "checks": result_checks}
    print(table([payload]))
    print()
    print(checks_table([BenchResult("multigpu", [], result_checks, {})]))
    print()
    print(
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs{', ' + machine['gpu'] if 'gpu' in machine else ''}, "
        f"torch {machine['torch']}; config {opts.config}, {opts.workers} worker(s)/rank, prefetch {opts.prefetch}, "
        f"{opts.steps} steps after {opts.warmup} warm-up; matmul {rows[0]['matmul_ms']:.3f} ms x "
        f"{rows[0]['matmuls_per_step']}/step."
    )
    path = opts.json or REPO / ".bench" / f"multigpu-{opts.device}-{world}x-{opts.step_ms:g}ms.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, allow_nan=True))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
