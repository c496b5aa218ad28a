"""What a source costs when there are many of them (issue 14): memory, state, fds, start-up, bytes.

For 3, 20, 100 and 1,000 sources (``--quick``: 3 and 100) of small local shards (each source 2 shards
of ``SAMPLES`` samples, lognormal lengths, median 200 tokens), a `Mixture` with
``TokenBudget(65536)`` streamed through `make_loader(num_workers=2)` for ``BATCHES`` batches, and
measured on this machine:

* `Mixture` construction time (main process: listing and profiling every source);
* RSS (``VmRSS``) and open file descriptors (``/proc/<pid>/fd``) of each worker, read while streaming
  (the most seen over the samples taken);
* samples buffered per reader, shuffle / buckets, counted from the saved state where it lists them
  (``—`` when the state format does not);
* ``loader.state_dict()`` of the rank: pickled and JSON sizes, and the time to build it;
* `Mixture` construction over those HTTP sources answered after ``TTFB_MS`` (an object store's time
  to first byte), without a profile cache, then with one cold and warm (the warm one must send no GET);
* over loopback HTTP at 100 sources (a server in its own process that counts the body bytes it
  sends): bytes sent / bytes delivered (tar bytes of the delivered samples) in the steady state
  (from batch ``BATCHES // 4`` on), split into the storage layer's part (bytes sent / tar bytes the
  readers took from shards, ``Counters.bytes``) and the buffers' part (taken / delivered: samples
  read into shuffle and bucket buffers ahead of delivery), and the GETs made; the most concurrent
  connections seen.

Read the figures with the mixing in mind: a ``TokenBudget(65536)`` batch comes from one source
(``mix="source"``), so ``BATCHES`` batches over 2 workers touch at most ``BATCHES / 2`` sources per
worker (~100 of 1,000 at the full size: ``--batches`` runs longer), and the buffered counts and
state size are those of each reader's last saved state (every ``state_every`` = 64 of its batches).

Nothing is judged here yet (the targets of issue 14 are shown as checks with their target and
PASS/MISS): the first run is the "before" column.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import os
import pickle
import re
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import common
from .many_http import SLOW, TTFB_MS, counting_server

NAME = "many_sources"
COUNTS = {"full": (3, 20, 100, 1000), "quick": (3, 100)}
HTTP_SOURCES = 100
SHARDS = 2
SAMPLES = 120
MAX_TOKENS = 65536
BATCHES = {"full": 200, "quick": 150}  # each reader (worker) carries its state from its 64th batch on (state_every)
WORKERS = 2
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


# --------------------------------------------------------------------------------------------------
# shards: source i is folder s{i:04d}, shards s{i:04d}-00000{0,1}.tar; sample sizes in tar bytes


def _npy(tokens: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, tokens, allow_pickle=False)
    return buf.getvalue()


def ensure_sources(n: int, bench_dir: Path, log: Callable[[str], None]) -> tuple[Path, dict[str, int]]:
    """``n`` sources under ``bench_dir/many_sources`` (written once, extended as needed); returns the
    root and the tar bytes of every sample by key (header, data and padding)."""
    root = bench_dir / NAME
    root.mkdir(parents=True, exist_ok=True)
    manifest_path = root / MANIFEST
    manifest: dict[str, Any] = {"version": MANIFEST_VERSION, "sources": 0, "sizes": {}}
    if manifest_path.exists():
        loaded = json.loads(manifest_path.read_text())
        if loaded.get("version") == MANIFEST_VERSION:
            manifest = loaded
    have = int(manifest["sources"])
    if have < n:
        log(f"writing sources {have}..{n - 1} ({SHARDS} shards x {SAMPLES} samples each)")
        for i in range(have, n):
            rng = np.random.default_rng(1000 + i)
            folder = root / f"s{i:04d}"
            folder.mkdir(exist_ok=True)
            for shard in range(SHARDS):
                lengths = np.clip(rng.lognormal(math.log(200), 0.8, SAMPLES), 16, 8192).astype(int)
                path = folder / f"s{i:04d}-{shard:06d}.tar"
                with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
                    for j, length in enumerate(lengths):
                        key = f"s{i:04d}-{shard:06d}-{j:06d}"
                        data = _npy(rng.integers(1, 50_000, int(length)).astype(np.int32))
                        info = tarfile.TarInfo(f"{key}.tokens.npy")
                        info.size, info.mtime = len(data), common.MTIME
                        tar.addfile(info, io.BytesIO(data))
                        manifest["sizes"][key] = 512 + -(-len(data) // 512) * 512
        manifest["sources"] = n
        tmp = manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, manifest_path)
    return root, manifest["sizes"]


def _pattern(i: int) -> str:
    return f"s{i:04d}/s{i:04d}-{{000000..{SHARDS - 1:06d}}}.tar"


# --------------------------------------------------------------------------------------------------
# /proc


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def _rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
        return int(m.group(1)) / 1024 if m else None
    return None


def _fds(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return None


def _buffered(state: dict[str, Any]) -> tuple[float | None, float | None]:
    """Samples per reader held in shuffle buffers / in bucket buffers, from the locations the saved
    state lists (expanded with ``mixer.state.checkpoint.readable``); None where the format says otherwise."""
    shuffle, buckets, readers = 0, 0, 0
    try:
        for reader in state["readers"]:
            if reader.get("snapshot") is None:
                continue
            snap = reader["snapshot"]
            readers += 1
            if isinstance(snap["streams"], dict):  # the columnar state (version 5 on); before: one dict per source
                from mixer.state.checkpoint import buffered

                a, b = buffered(snap)
                shuffle, buckets = shuffle + a, buckets + b
                continue
            shuffle += sum(len(s["buffer"]) for s in snap["streams"])
            buckets += sum(len(group) for b in snap["batchers"] for group in (*b["buffers"], *b["ready"]))
    except (KeyError, TypeError, ValueError):
        return None, None
    return (shuffle / readers, buckets / readers) if readers else (None, None)


# --------------------------------------------------------------------------------------------------
# one measurement


def measure(
    n: int,
    root: Path,
    sizes: dict[str, int],
    batches: int,
    log: Callable[[str], None],
    base: str | None = None,
    counters: tuple[Any, ...] | None = None,
) -> dict[str, Any]:
    import mixer

    prefix = base if base is not None else str(root) + "/"
    sources = [mixer.Source(f"s{i:04d}", prefix + _pattern(i)) for i in range(n)]
    gc.collect()
    t0 = time.perf_counter()
    mix = mixer.Mixture(sources, batching=mixer.TokenBudget(MAX_TOKENS), seed=0)
    build_s = time.perf_counter() - t0
    loader = mixer.make_loader(mix, num_workers=WORKERS)
    rss: dict[int, float] = {}
    fds: dict[int, int] = {}
    delivered = 0
    steady_from = batches // 4
    sent0 = gets0 = consumed0 = 0
    steady_delivered = 0
    t1 = time.perf_counter()
    first_batch_s = None
    done = 0
    for done, batch in enumerate(loader, 1):
        if first_batch_s is None:
            first_batch_s = time.perf_counter() - t1
        nbytes = sum(sizes.get(k, 0) for k in batch.keys)
        delivered += nbytes
        if counters is not None and done == steady_from:
            sent0, gets0 = counters[0].value, counters[1].value
            consumed0 = _consumed(loader)
        elif done > steady_from:
            steady_delivered += nbytes
        if done % 10 == 0 or done == batches:
            for pid in _children():
                r, f = _rss_mb(pid), _fds(pid)
                if r is not None and r > 50:  # a DataLoader worker (not a tiny helper process)
                    rss[pid] = max(rss.get(pid, 0.0), r)
                    fds[pid] = max(fds.get(pid, 0), f or 0)
        if done >= batches:
            break
    stream_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    state = loader.state_dict()
    state_s = time.perf_counter() - t2
    pickled = len(pickle.dumps(state))
    as_json = len(json.dumps(state))
    shuffle, buckets = _buffered(state)
    row: dict[str, Any] = {
        "sources": n,
        "transport": "http" if base is not None else "local",
        "batches": done,
        "build_s": build_s,
        "first_batch_s": first_batch_s,
        "stream_s": stream_s,
        "worker_rss_mb": sorted(rss.values()),
        "worker_fds": sorted(fds.values()),
        "buffered_shuffle": shuffle,
        "buffered_buckets": buckets,
        "state_pickled_bytes": pickled,
        "state_json_bytes": as_json,
        "state_s": state_s,
        "delivered_bytes": delivered,
    }
    if counters is not None:
        sent = counters[0].value - sent0
        consumed = _consumed(loader) - consumed0
        row.update(
            steady_consumed_bytes=consumed,
            sent_over_consumed=sent / consumed if consumed else None,
            consumed_over_delivered=consumed / steady_delivered if steady_delivered else None,
            steady_sent_bytes=sent,
            steady_delivered_bytes=steady_delivered,
            read_over_delivered=sent / steady_delivered if steady_delivered else None,
            steady_gets=counters[1].value - gets0,
            peak_connections=counters[3].value,
        )
    del loader, mix
    gc.collect()
    if counters is None:  # (with the HTTP server running, its process is a child too)
        common.reap_children()
    return row


def _consumed(loader: Any) -> int:
    """Tar bytes the readers took from shards (``Counters.bytes``, counted as each shard closes)."""
    return sum(c["bytes"] for c in loader.counters().values())


def startup(
    n: int, root: Path, port: int, counters: tuple[Any, ...], cache_dir: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """`Mixture` construction over ``n`` HTTP sources answered after ``TTFB_MS``: without a profile
    cache, then with one twice (cold: profiles and writes it; warm: must read no shard)."""
    import mixer

    def build(cache: Path | None) -> tuple[float, int, int]:
        sources = [mixer.Source(f"s{i:04d}", f"http://127.0.0.1:{port}/{SLOW}" + _pattern(i)) for i in range(n)]
        gets0, sent0 = counters[1].value, counters[0].value
        t0 = time.perf_counter()
        mixer.Mixture(
            sources, batching=mixer.TokenBudget(MAX_TOKENS), seed=0, profile_cache=None if cache is None else str(cache)
        )
        return time.perf_counter() - t0, counters[1].value - gets0, counters[0].value - sent0

    import shutil

    shutil.rmtree(cache_dir, ignore_errors=True)
    plain = build(None)
    cold = build(cache_dir)
    warm = build(cache_dir)
    shutil.rmtree(cache_dir, ignore_errors=True)
    log(
        f"start-up, {n} HTTP sources at {TTFB_MS} ms TTFB: {plain[0]:.2f} s ({plain[1]} GETs); cached: cold "
        f"{cold[0]:.2f} s, warm {warm[0]:.2f} s ({warm[1]} GETs)"
    )
    return {
        "sources": n,
        "ttfb_ms": TTFB_MS,
        "build_s": plain[0],
        "build_gets": plain[1],
        "build_sent_bytes": plain[2],
        "cold_s": cold[0],
        "warm_s": warm[0],
        "warm_gets": warm[1],
    }


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB" if x >= 1e5 else f"{x / 1e3:.1f} kB"


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "sources",
        "via",
        "RSS per worker",
        "buffered per reader (shuffle / buckets)",
        "state_dict() per rank (pickled / JSON; build)",
        "open fds per worker",
        "Mixture() s",
        "read / delivered (steady)",
    ]
    body = []
    for r in rows:
        rss = r["worker_rss_mb"]
        fds = r["worker_fds"]
        buffered = (
            "—" if r["buffered_shuffle"] is None else f"{r['buffered_shuffle']:,.0f} / {r['buffered_buckets']:,.0f}"
        )
        ratio = "—"
        if r.get("read_over_delivered") is not None:
            ratio = f"{r['read_over_delivered']:.2f} ({r['steady_gets']} GETs, peak {r['peak_connections']} conns)"
        body.append(
            [
                f"{r['sources']:,}",
                r["transport"],
                "—" if not rss else "-".join(f"{x:.0f}" for x in (min(rss), max(rss))) + " MB",
                buffered,
                f"{_mb(r['state_pickled_bytes'])} / {_mb(r['state_json_bytes'])}; {1e3 * r['state_s']:.0f} ms",
                "—" if not fds else "-".join(str(x) for x in sorted({min(fds), max(fds)})),
                f"{r['build_s']:.2f}",
                ratio,
            ]
        )
    return common.markdown_table(header, body)


def io_table(rows: list[dict[str, Any]], start: dict[str, Any] | None) -> str:
    """The I/O rows: bytes the server sent per byte delivered, split into the storage layer's share
    (sent / tar bytes the readers took) and the buffers' (taken / delivered); start-up at TTFB_MS."""
    header = [
        "sources (HTTP)",
        "sent / delivered",
        "sent / taken (I/O)",
        "taken / delivered (buffers)",
        "GETs (steady)",
        "peak conns",
    ]
    body = [
        [
            f"{r['sources']:,}",
            f"{r['read_over_delivered']:.2f}",
            _ratio(r.get("sent_over_consumed")),
            _ratio(r.get("consumed_over_delivered")),
            str(r["steady_gets"]),
            str(r["peak_connections"]),
        ]
        for r in rows
        if r.get("read_over_delivered") is not None
    ]
    out = common.markdown_table(header, body)
    if start is not None:
        out += (
            f"\n\n`Mixture()` over {start['sources']} HTTP sources at {start['ttfb_ms']} ms to first byte: "
            f"{start['build_s']:.2f} s ({start['build_gets']} GETs, {_mb(start['build_sent_bytes'])} sent); with a "
            f"profile cache: cold {start['cold_s']:.2f} s, warm {start['warm_s']:.2f} s with {start['warm_gets']} GETs"
        )
    return out


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def to_row(r: dict[str, Any]) -> dict[str, Any]:
    label = f"{r['sources']} sources ({r['transport']})"
    rss = r["worker_rss_mb"]
    note = (
        f"{r['batches']} batches in {r['stream_s']:.1f} s; Mixture() {r['build_s']:.2f} s; state "
        f"{_mb(r['state_pickled_bytes'])} pickled, {_mb(r['state_json_bytes'])} JSON, {1e3 * r['state_s']:.0f} ms; "
        f"fds/worker {r['worker_fds']}"
    )
    if r.get("read_over_delivered") is not None:
        note += (
            f"; read/delivered {r['read_over_delivered']:.2f}, {r['steady_gets']} GETs, peak "
            f"{r['peak_connections']} connections"
        )
    return {
        "bench": NAME,
        "method": label,
        "label": label,
        "kind": "scale",
        "status": "ok",
        "note": note,
        "worker_rss_mb": max(rss) if rss else None,
        **{k: v for k, v in r.items() if k != "worker_rss_mb"},
        "worker_rss_mb_all": rss,
    }


def checks_for(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    local = {r["sources"]: r for r in rows if r["transport"] == "local"}
    checks = []
    lo, hi = min(local), max(local)
    if local[lo]["worker_rss_mb"] and local[hi]["worker_rss_mb"]:
        ratio = max(local[hi]["worker_rss_mb"]) / max(local[lo]["worker_rss_mb"])
        checks.append(common.value_check(NAME, f"RSS per worker, {hi} / {lo} sources", ratio, 1.5, "<="))
    checks.append(
        common.value_check(
            NAME,
            f"state_dict() pickled KB per rank at {hi} sources",
            local[hi]["state_pickled_bytes"] / 1024,
            256,
            "<=",
        )
    )
    checks.append(
        common.value_check(NAME, f"state_dict() build ms at {hi} sources", 1e3 * local[hi]["state_s"], 50, "<=")
    )
    if local[hi]["worker_fds"]:
        checks.append(
            common.value_check(NAME, f"open fds per worker at {hi} sources", max(local[hi]["worker_fds"]), 64, "<=")
        )
        if lo < hi and len(local[lo]["worker_fds"]) == len(local[hi]["worker_fds"]):
            # What a worker holds besides shards (DataLoader pipes, shared memory, the interpreter;
            # the workers differ by a few): its fds at `lo` sources less those `lo` shards, paired
            # worker for worker in sorted order; the rest must stay within the cap.
            own = [f - lo for f in sorted(local[lo]["worker_fds"])]
            beyond = max(f - o for f, o in zip(sorted(local[hi]["worker_fds"]), own))
            checks.append(
                common.value_check(
                    NAME, f"open fds per worker at {hi} sources beyond a worker's own ({own})", beyond, 64, "<="
                )
            )
    for r in rows:
        if r.get("read_over_delivered") is not None:
            checks.append(
                common.value_check(
                    NAME, f"bytes read / delivered at {r['sources']} HTTP sources", r["read_over_delivered"], 1.2, "<="
                )
            )
        if r.get("sent_over_consumed") is not None:
            checks.append(
                common.value_check(
                    NAME,
                    f"bytes sent / taken by readers at {r['sources']} HTTP sources",
                    r["sent_over_consumed"],
                    1.2,
                    "<=",
                )
            )
    return checks


def startup_checks(start: dict[str, Any] | None) -> list[dict[str, Any]]:
    if start is None:
        return []
    return [
        common.value_check(
            NAME,
            f"Mixture() s, {start['sources']} HTTP sources at {start['ttfb_ms']} ms TTFB",
            start["build_s"],
            3.0,
            "<=",
        ),
        common.value_check(
            NAME, "shard GETs of a Mixture() with the profile cache present", start["warm_gets"], 0, "<="
        ),
    ]


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    counts = COUNTS[opts.profile]
    counts = tuple(getattr(opts, "sources", None) or counts)
    batches = getattr(opts, "batches", None) or BATCHES[opts.profile]
    http_n = getattr(opts, "http_sources", None)
    http_n = HTTP_SOURCES if http_n is None else http_n
    root, sizes = ensure_sources(max((*counts, http_n)), opts.bench_dir, log)
    rows = []
    start = None
    for n in counts:
        t0 = time.perf_counter()
        try:
            r = measure(n, root, sizes, batches, log)
        except Exception as exc:  # noqa: BLE001 (reported as a failed row, the rest still runs)
            log(f"{n} sources: failed: {type(exc).__name__}: {exc}")
            rows.append(
                {
                    "bench": NAME,
                    "method": f"{n} sources (local)",
                    "label": f"{n} sources (local)",
                    "status": "error",
                    "note": str(exc)[:300],
                }
            )
            continue
        log(
            f"{n} local sources: RSS/worker {r['worker_rss_mb']} MB, state {r['state_pickled_bytes']} B "
            f"[{time.perf_counter() - t0:.1f} s]"
        )
        rows.append(r)
    if http_n:
        with counting_server(root) as (port, counters):
            t0 = time.perf_counter()
            try:
                r = measure(http_n, root, sizes, batches, log, base=f"http://127.0.0.1:{port}/", counters=counters)
                log(
                    f"{http_n} HTTP sources: read/delivered {r['read_over_delivered']}, peak {r['peak_connections']} "
                    f"connections [{time.perf_counter() - t0:.1f} s]"
                )
                rows.append(r)
            except Exception as exc:  # noqa: BLE001
                log(f"{http_n} HTTP sources: failed: {type(exc).__name__}: {exc}")
                rows.append(
                    {
                        "bench": NAME,
                        "method": f"{http_n} sources (http)",
                        "label": f"{http_n} sources (http)",
                        "status": "error",
                        "note": str(exc)[:300],
                    }
                )
            start = startup(http_n, root, port, counters, opts.bench_dir / f"{NAME}.profiles", log)
    good = [r for r in rows if r.get("status") != "error"]
    log("\n" + table(good) + "\n\n" + io_table(good, start))
    config = {
        "profile": opts.profile,
        "counts": counts,
        "shards_per_source": SHARDS,
        "samples_per_shard": SAMPLES,
        "batches": batches,
        "max_tokens": MAX_TOKENS,
        "workers": WORKERS,
        "http_sources": http_n,
        "table": table(good),
        "io_table": io_table(good, start),
        "startup": start,
    }
    result_rows = [to_row(r) if r.get("status") != "error" else r for r in rows]
    checks = checks_for(good) if any(r["transport"] == "local" for r in good) else []
    return common.BenchResult(NAME, result_rows, checks + startup_checks(start), config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.many_sources", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--sources", type=lambda s: [int(x) for x in s.split(",")], default=None, help="comma-separated source counts"
    )
    p.add_argument("--batches", type=int, default=None)
    p.add_argument("--http-sources", type=int, default=None, help="sources of the HTTP run (0: none)")
    p.add_argument("--bench-dir", type=Path, default=common.DEFAULT_BENCH_DIR)
    return common.standalone(
        NAME,
        p,
        run,
        argv,
        tables=(
            "table",
            "io_table",
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
