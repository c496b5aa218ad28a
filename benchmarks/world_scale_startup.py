"""Start-up at world scale: `Mixture()` over many remote prefix sources, on the rank that does the work
and on the others, with the requests and bytes the storage saw (issue 24, item 2).

    python -m benchmarks.world_scale_startup [--quick] [--sources 100,300,1000] [--ranks 4]

For each source count: ``n`` sources, each a remote prefix (``http://.../sNNNN/``) of 2 shards of
200 samples (lognormal lengths, median 300 int32 tokens: ~2 kB a sample, ~400 kB a shard), served
by a loopback HTTP server in its own process that answers every request (LIST, HEAD, GET) after
``TTFB_MS`` and counts them and the body bytes it sends. Measured:

* ``before``: what building a mixture did before start-up was shared: the sources listed one after
  another (`mixer.plan.profiling.list_source`), and the look as it was (16 sources at once, no byte
  bound), in this process;
* ``world 1``: `Mixture()` under ``torchrun --nproc_per_node=1`` (a fresh process: the rank that does
  the work, as in any job);
* ``world R``: the same under ``torchrun --nproc_per_node=R`` (gloo): rank 0 lists, looks and
  broadcasts; the other ranks call `Mixture()` once rank 0 has finished its work (it logs so), so
  their time is their own: receiving and building from what rank 0 found;
* the requests of each job by kind, which must not depend on ``R``, and the shard bytes read;
* the size estimates against the exact token counts (mean and max relative error over the sources),
  before and now;
* the same mixture with every source read through its shard index (``index=True``, built beforehand):
  a HEAD per shard, once per job, and one GET of the index file per rank.

Targets (1,000 sources): `Mixture()` <= 5 s on the working rank, <= 1 s on the others, <= 200 MB read,
requests per job independent of the number of ranks. Shards are hard links to a few distinct templates
(disk stays small; every source is listed, looked at and estimated on its own).
"""

from __future__ import annotations

import argparse
import contextlib
import html
import io
import json
import logging
import math
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TTFB_MS = 50
COUNTS = {"full": (100, 300, 1000), "quick": (10, 40), "smoke": (10,)}
RANKS = 4
SMOKE_RANKS = 2  # the test suite's size: the fewest ranks that still split the work from the rest
TEMPLATES = 16  # distinct sources; source i links template i % TEMPLATES
SHARDS = 2
SAMPLES = 200
MAX_TOKENS = 65536
MTIME = 1_700_000_000
READY = "ready"  # the file rank 0 writes once its start-up work is done
TARGETS = {"work_s": 5.0, "others_s": 1.0, "bytes": 200e6}


# --------------------------------------------------------------------------------------------------
# shards


def _npy(tokens: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, tokens, allow_pickle=False)
    return buf.getvalue()


def _template(folder: Path, t: int) -> int:
    """Template ``t``: ``shard-00000{0,1}.tar`` under ``folder``; returns its exact token count."""
    rng = np.random.default_rng(2400 + t)
    tokens = 0
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(SHARDS):
        lengths = np.clip(rng.lognormal(math.log(300), 0.8, SAMPLES), 16, 4096).astype(int)
        tokens += int(lengths.sum())
        with tarfile.open(folder / f"shard-{shard:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for j, n in enumerate(lengths):
                data = _npy(rng.integers(1, 50_000, int(n)).astype(np.int32))
                info = tarfile.TarInfo(f"t{t:02d}-{shard:06d}-{j:06d}.tokens.npy")
                info.size, info.mtime = len(data), MTIME
                tar.addfile(info, io.BytesIO(data))
    return tokens


def ensure_data(root: Path, n: int) -> list[int]:
    """Sources ``s0000 .. s{n-1}`` under ``root`` (hard links to the templates, each with the
    template's shard index); returns each source's exact token count."""
    manifest = root / "templates.json"
    if manifest.exists():
        tokens = json.loads(manifest.read_text())
    else:
        import mixer

        tokens = []
        for t in range(TEMPLATES):
            folder = root / "templates" / f"t{t:02d}"
            tokens.append(_template(folder, t))
            mixer.build_index(str(folder / "shard-{000000..000001}.tar"))
        manifest.write_text(json.dumps(tokens))
    for i in range(n):
        folder = root / "sources" / f"s{i:04d}"
        if (folder / "mixer-index.json.gz").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        template = root / "templates" / f"t{i % TEMPLATES:02d}"
        for name in [f"shard-{s:06d}.tar" for s in range(SHARDS)] + ["mixer-index.json.gz"]:
            with contextlib.suppress(FileExistsError):
                os.link(template / name, folder / name)
    return [tokens[i % TEMPLATES] for i in range(n)]


# --------------------------------------------------------------------------------------------------
# the server (its own process): every request answered after TTFB_MS, counted


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path
    counters: dict[str, Any]  # multiprocessing.Value each: LIST, HEAD, GET, bytes

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _count(self, kind: str, n: int = 1) -> None:
        value = self.counters[kind]
        with value.get_lock():
            value.value += n

    def _target(self) -> Path | None:
        time.sleep(TTFB_MS / 1000)  # an object store's time to first byte, for every request
        rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        path = (self.root / rel).resolve()
        if path != self.root and self.root not in path.parents or not path.exists():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return path

    def do_HEAD(self) -> None:
        self._count("HEAD")
        path = self._target()
        if path is None:
            return
        size = path.stat().st_size
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{size}"')
        self.end_headers()

    def do_GET(self) -> None:
        if urllib.parse.urlsplit(self.path).path.endswith("/"):
            self._count("LIST")
            path = self._target()
            if path is None:
                return
            names = sorted(p.name for p in path.iterdir())
            base = urllib.parse.urlsplit(self.path).path
            body = "".join(f'<a href="{html.escape(base + urllib.parse.quote(x))}">{x}</a>\n' for x in names).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._count("GET")
        path = self._target()
        if path is None:
            return
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            start = int(m.group(1)) if m else 0
            stop = min(int(m.group(2)) + 1, size) if m and m.group(2) else size
            if m and start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206 if m else 200)
            self.send_header("Content-Length", str(stop - start))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{size}"')
            if m:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
            self.end_headers()
            self.wfile.flush()
            try:  # (sendfile: the server's CPU is not what is measured)
                sent = self.connection.sendfile(f, start, stop - start)
                self._count("bytes", sent)
            except OSError:
                self.close_connection = True


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # (a class attribute: listen() is called in the constructor) no SYN waits for a retry
    daemon_threads = True


def _serve(root: str, conn: Any, counters: dict[str, Any]) -> None:
    handler = type("Handler", (_Handler,), {"root": Path(root).resolve(), "counters": counters})
    server = _Server(("127.0.0.1", 0), handler)
    conn.send(server.server_address[1])
    server.serve_forever(poll_interval=0.1)


class Server:
    """`_serve` in a spawned process; `take()` returns the counts since the last `take()`."""

    KINDS = ("LIST", "HEAD", "GET", "bytes")

    def __init__(self, root: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.counters = {k: ctx.Value("q", 0) for k in self.KINDS}
        parent, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(str(root), child, self.counters), daemon=True)
        self.process.start()
        if not parent.poll(60):
            self.process.terminate()
            raise RuntimeError("the benchmark server did not start within 60 s")
        self.port = int(parent.recv())

    def url(self, rel: str) -> str:
        return f"http://127.0.0.1:{self.port}/{rel}"

    def take(self) -> dict[str, int]:
        out = {}
        for k, v in self.counters.items():
            with v.get_lock():
                out[k], v.value = int(v.value), 0
        return out

    def close(self) -> None:
        self.process.terminate()
        self.process.join(10)


# --------------------------------------------------------------------------------------------------
# one rank of a torchrun job (python -m benchmarks.world_scale_startup --worker SPEC OUT)


def _worker(spec_path: str, out_dir: str) -> int:
    import torch.distributed as dist

    import mixer

    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_dir)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sources = [mixer.Source(name, url, index=spec["index"]) for name, url in spec["sources"]]
    if rank == 0:

        class Ready(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.getMessage().startswith("start-up:"):
                    (out / READY).touch()

        logger = logging.getLogger("mixer.plan.startup")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(Ready())
    else:  # wait until rank 0 has done the work: what is timed below is this rank's own part
        while not (out / READY).exists():
            time.sleep(0.005)
    t0, c0 = time.perf_counter(), _cpu()
    mix = mixer.Mixture(sources, batching=mixer.TokenBudget(MAX_TOKENS), seed=0)
    seconds, cpu = time.perf_counter() - t0, _cpu() - c0
    result = {"rank": rank, "world": world, "seconds": seconds, "cpu_s": cpu, "sizes": list(mix.sizes.values())}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _cpu() -> float:
    """CPU seconds of this process, every thread (the look and the listings run in threads)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _torchrun(nproc: int, sources: list[tuple[str, str]], index: bool, work: Path) -> list[dict[str, Any]]:
    out = Path(tempfile.mkdtemp(prefix=f"w{nproc}-", dir=work))
    spec = out / "spec.json"
    spec.write_text(json.dumps({"sources": sources, "index": index}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "-m",
        "benchmarks.world_scale_startup",
        "--worker",
        str(spec),
        str(out),
    ]
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun x{nproc} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


# --------------------------------------------------------------------------------------------------
# the measurements


def _errors(sizes: list[float], truth: list[int]) -> tuple[float, float]:
    rel = np.abs(np.asarray(sizes) / np.asarray(truth, dtype=np.float64) - 1.0)
    return float(rel.mean()), float(rel.max())


def _before(server: Server, sources: list[tuple[str, str]], truth: list[int]) -> dict[str, Any]:
    """The listing one source after another and the look as it was (16 at once, no byte bound)."""
    import mixer
    from mixer.plan.profiling import list_source, profile_sources
    from mixer.storage.filesystems import close_filesystems

    server.take()
    t0, c0 = time.perf_counter(), _cpu()
    listed = [list_source(mixer.Source(name, url)) for name, url in sources]
    t1 = time.perf_counter()
    profiles = profile_sources(
        listed, mixer.TokenBudget(MAX_TOKENS), share=False, concurrency=16, max_bytes=1 << 62, max_total_bytes=1 << 62
    )
    t2, c2 = time.perf_counter(), _cpu()
    close_filesystems()
    counts = server.take()
    mean, worst = _errors([p.size for p in profiles], truth)
    return {
        "list_s": t1 - t0,
        "look_s": t2 - t1,
        "seconds": t2 - t0,
        "cpu_s": c2 - c0,
        "requests": {k: counts[k] for k in ("LIST", "HEAD", "GET")},
        "bytes": counts["bytes"],
        "size_error_mean": mean,
        "size_error_max": worst,
    }


def measure(n: int, server: Server, root: Path, truth: list[int], ranks: int, work: Path) -> dict[str, Any]:
    sources = [(f"s{i:04d}", server.url(f"sources/s{i:04d}/")) for i in range(n)]
    row: dict[str, Any] = {"sources": n, "shards": n * SHARDS, "ranks": ranks, "ttfb_ms": TTFB_MS}
    row["before"] = _before(server, sources, truth)
    for label, index in (("look", False), ("index", True)):
        jobs = {}
        for nproc in (1, ranks):
            server.take()
            results = _torchrun(nproc, sources, index, work)
            counts = server.take()
            others = [r["seconds"] for r in results if r["rank"] != 0]
            jobs[nproc] = {
                "work_s": results[0]["seconds"],
                "work_cpu_s": results[0]["cpu_s"],
                "others_s_max": max(others) if others else None,
                "others_cpu_s_max": max((r["cpu_s"] for r in results if r["rank"] != 0), default=None),
                "requests": {k: counts[k] for k in ("LIST", "HEAD", "GET")},
                "bytes": counts["bytes"],
                "same_sizes": all(r["sizes"] == results[0]["sizes"] for r in results),
            }
            if nproc == 1 and not index:
                jobs[nproc]["size_error_mean"], jobs[nproc]["size_error_max"] = _errors(results[0]["sizes"], truth)
        row[label] = {"world1": jobs[1], f"world{ranks}": jobs[ranks]}
    return row


def checks(row: dict[str, Any]) -> dict[str, bool]:
    """The targets, judged at this row's size (the issue states them at 1,000 sources)."""
    r = row["ranks"]
    look, index = row["look"], row["index"]
    equal_look = look["world1"]["requests"] == look[f"world{r}"]["requests"]
    idx1, idxr = index["world1"]["requests"], index[f"world{r}"]["requests"]
    equal_index = (idx1["LIST"], idx1["HEAD"]) == (idxr["LIST"], idxr["HEAD"])
    return {
        "work_s <= 5": look[f"world{r}"]["work_s"] <= TARGETS["work_s"],
        "others_s <= 1": (look[f"world{r}"]["others_s_max"] or 0.0) <= TARGETS["others_s"],
        "bytes <= 200 MB": look["world1"]["bytes"] <= TARGETS["bytes"],
        "requests independent of ranks (look)": equal_look,
        "LIST + HEAD independent of ranks (index)": equal_index,
    }


def run(
    profile: str, *, counts: tuple[int, ...] | None = None, ranks: int | None = None, bench_dir: Path | None = None
) -> list[dict[str, Any]]:
    """One row per source count of ``profile`` (see the module docstring), at ``ranks`` ranks (4; 2 for
    ``smoke``)."""
    counts = counts or COUNTS[profile]
    ranks = ranks or (SMOKE_RANKS if profile == "smoke" else RANKS)
    base = bench_dir or REPO / ".bench"
    root = base / "world_scale_startup"
    root.mkdir(parents=True, exist_ok=True)
    truth = ensure_data(root, max(counts))
    server = Server(root)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="world-scale-startup-") as work:
            for n in counts:
                row = measure(n, server, root, truth[:n], ranks, Path(work))
                row["checks"] = checks(row)
                rows.append(row)
                print(_line(row), file=sys.stderr, flush=True)
    finally:
        server.close()
    return rows


def _line(row: dict[str, Any]) -> str:
    r = row["ranks"]
    look, index, before = row["look"], row["index"], row["before"]
    return (
        f"{row['sources']:>5} sources: before {before['seconds']:.2f} s ({before['list_s']:.2f} s listing), "
        f"{before['bytes'] / 1e6:.1f} MB, {before['requests']}; now world 1 {look['world1']['work_s']:.2f} s, "
        f"world {r}: rank 0 {look[f'world{r}']['work_s']:.2f} s, others <= {look[f'world{r}']['others_s_max']:.2f} s, "
        f"{look['world1']['bytes'] / 1e6:.1f} MB, "
        f"requests {look['world1']['requests']} / {look[f'world{r}']['requests']}; "
        f"size error mean {look['world1']['size_error_mean']:.3%} max {look['world1']['size_error_max']:.3%} "
        f"(before {before['size_error_mean']:.3%} / {before['size_error_max']:.3%}); "
        f"indexed: world 1 {index['world1']['work_s']:.2f} s, world {r} rank 0 {index[f'world{r}']['work_s']:.2f} s, "
        f"others <= {index[f'world{r}']['others_s_max']:.2f} s, requests {index['world1']['requests']} / "
        f"{index[f'world{r}']['requests']}"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as one Markdown table."""
    r = rows[0]["ranks"] if rows else RANKS
    head = (
        f"| sources | before: s (listing s) | before: MB | world 1: s (CPU s) | world {r}: rank 0 s "
        f"| world {r}: others s | "
        f"MB read | requests (LIST/HEAD/GET) at 1 / {r} ranks | size error mean / max (before) | "
        f"indexed: rank 0 / others s | indexed LIST/HEAD/GET at 1 / {r} ranks |"
    )
    lines = [head, "|" + "---|" * 11]
    for row in rows:
        look, index, before = row["look"], row["index"], row["before"]

        def req(d: dict[str, int]) -> str:
            return f"{d['LIST']}/{d['HEAD']}/{d['GET']}"

        lines.append(
            f"| {row['sources']:,} | {before['seconds']:.2f} ({before['list_s']:.2f}) | {before['bytes'] / 1e6:.1f} | "
            f"{look['world1']['work_s']:.2f} ({look['world1']['work_cpu_s']:.2f}) | "
            f"{look[f'world{r}']['work_s']:.2f} | "
            f"{look[f'world{r}']['others_s_max']:.2f} | "
            f"{look['world1']['bytes'] / 1e6:.1f} | "
            f"{req(look['world1']['requests'])} / {req(look[f'world{r}']['requests'])} | "
            f"{look['world1']['size_error_mean']:.2%} / {look['world1']['size_error_max']:.2%} "
            f"({before['size_error_mean']:.2%} / {before['size_error_max']:.2%}) | "
            f"{index[f'world{r}']['work_s']:.2f} / {index[f'world{r}']['others_s_max']:.2f} | "
            f"{req(index['world1']['requests'])} / {req(index[f'world{r}']['requests'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1], argv[2])
    p = argparse.ArgumentParser(prog="python -m benchmarks.world_scale_startup", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"source counts {COUNTS['quick']} (default {COUNTS['full']})")
    p.add_argument("--sources", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    p.add_argument("--ranks", type=int, default=RANKS)
    p.add_argument("--bench-dir", type=Path, default=REPO / ".bench")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    opts = p.parse_args(argv)
    rows = run("quick" if opts.quick else "full", counts=opts.sources, ranks=opts.ranks, bench_dir=opts.bench_dir)
    print(table(rows))
    missed = [f"{row['sources']} sources: {name}" for row in rows for name, ok in row["checks"].items() if not ok]
    print("\n" + ("targets (judged at every size): all met" if not missed else "missed: " + "; ".join(missed)))
    if opts.json is not None:
        opts.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
