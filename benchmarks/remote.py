"""The mixer over loopback HTTP vs the same shards from local disk, in one run (issue 5, item 6).

Methods (alternating within each round, order rotated per round), all one pass over the web/code/books
shard set (`stop="all_exhausted"`) through `mixer.make_loader(num_workers=0)`, as `throughput`'s
`mixer_all_exhausted`:

* `local` — the shards by path (plain files, the page cache warm).
* `http` — the same shards as `http://127.0.0.1:PORT/...` URLs, read through `mixer.storage`'s
  `RemoteStream`s with the default read-ahead (`io_options={"read_ahead": 2}`: while one shard is
  decoded, the next two are already downloading).
* `http_no_ahead` — the same with `read_ahead=0`: one shard open at a time (what read-ahead buys).
* `http_ttfb`, `http_ttfb_no_ahead` — `http` and `http_no_ahead` against a server that waits
  ``TTFB_MS`` before answering each request, as an object store does (S3's time to first byte is
  typically tens of ms): loopback has no latency to hide, this shows what read-ahead hides.
* `http_raw` — `mixer.storage.open_shard` over every shard URL, bytes only (1 MiB reads): the transport's
  ceiling on this machine, no tar parsing, decoding or batching.

The server is a small range-capable HTTP/1.1 file server in its own process (`os.sendfile`, so it costs
the mixer's process nothing but the loopback copy), started once for the whole benchmark. Target:
HTTP real tokens/s >= 0.8x local. Every round checks that both deliver the whole shard set.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import multiprocessing
import os
import re
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from . import common
from .common import Method, ShardSet, Tally
from .many_http import SLOW, TTFB_MS, served_path
from .throughput import MAX_TOKENS, consume_mixer

NAME = "remote"
METHODS = ("local", "http", "http_no_ahead", "http_ttfb", "http_ttfb_no_ahead", "http_raw")


# --------------------------------------------------------------------------------------------------
# the server (its own process)


class _FileHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        path = served_path(self, self.root)
        if path is None:
            return
        rel = path.relative_to(self.root).as_posix()
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start, last, status = 0, size - 1, 200
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if m:  # from a byte to the end, or to an end byte (the profiling's bounded reads)
                start, status = int(m.group(1)), 206
                last = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            if start > size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/x-tar")
            self.send_header("Content-Length", str(max(last + 1 - start, 0)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", '"' + hashlib.md5(f"{rel}:{size}".encode()).hexdigest() + '"')
            if self.headers.get("Connection", "").lower() == "close":
                self.send_header("Connection", "close")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{last}/{size}")
            self.end_headers()
            self.wfile.flush()
            try:
                if last >= start:
                    self.connection.sendfile(f, start, last + 1 - start)
            except OSError:  # the client went away (e.g. a stream closed early)
                self.close_connection = True


def _serve(root: str, conn: Any) -> None:
    handler = type("Handler", (_FileHandler,), {"root": Path(root).resolve()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    conn.send(server.server_address[1])
    server.serve_forever(poll_interval=0.1)


class FileServer:
    """`_serve` in a spawned process; ``url(path)`` for a file under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(str(self.root), child), daemon=True, name="bench-http")
        self.process.start()
        if not parent.poll(60):
            self.process.terminate()
            raise RuntimeError("the benchmark HTTP server did not start within 60 s")
        self.port = int(parent.recv())

    def url(self, path: str | Path) -> str:
        rel = Path(path).resolve().relative_to(self.root).as_posix()
        return f"http://127.0.0.1:{self.port}/{rel}"

    def pattern(self, pattern: str, *, slow: bool = False) -> str:
        """A local brace pattern under ``root`` as the same pattern over HTTP (braces kept); ``slow``:
        answered after ``TTFB_MS``."""
        prefix = str(self.root) + os.sep
        if not pattern.startswith(prefix):
            raise ValueError(f"{pattern!r} is not under {self.root}")
        return f"http://127.0.0.1:{self.port}/" + (SLOW if slow else "") + pattern[len(prefix) :].replace(os.sep, "/")

    def close(self) -> None:
        self.process.terminate()
        self.process.join(10)


# --------------------------------------------------------------------------------------------------
# methods


def one_pass(shards: ShardSet, patterns: list[str], io_options: dict[str, Any] | None) -> Callable[[Tally], None]:
    """The mixer over ``patterns`` (one per source, in `shards.sources` order), one whole pass."""
    cap = 3 * shards.tokens

    def run(tally: Tally) -> None:
        import mixer

        sources = [
            mixer.Source(s.name, p, weight=s.weight, io_options=io_options) for s, p in zip(shards.sources, patterns)
        ]
        mix = mixer.Mixture(sources, batching=mixer.TokenBudget(max_tokens=MAX_TOKENS), seed=0, stop="all_exhausted")
        loader = mixer.make_loader(mix, num_workers=0)
        consume_mixer(loader, tally, cap)
        counters = loader.counters()
        retries = sum(c["retries"] for c in counters.values())
        skipped = sum(c["skipped_shards"] + c["skipped_samples"] for c in counters.values())
        if retries or skipped:
            tally.note(f"{retries} retries, {skipped} skips")
        if (tally.samples, tally.tokens) != (shards.samples, shards.tokens):
            raise RuntimeError(
                f"one pass delivered {tally.samples:,}/{shards.samples:,} samples, {tally.tokens:,}/{shards.tokens:,} "
                "tokens"
            )
        del loader, mix
        gc.collect()

    return run


def raw_http(shards: ShardSet, server: FileServer) -> Callable[[Tally], None]:
    def run(tally: Tally) -> None:
        from mixer import storage as mio

        buf = bytearray(1 << 20)
        total = 0
        for url in shards.urls:
            with mio.open_shard(server.url(url)) as stream:
                while n := stream.readinto(buf):  # type: ignore[attr-defined]
                    total += n
        if total != shards.bytes:
            raise RuntimeError(f"read {total:,} bytes over HTTP, the shards hold {shards.bytes:,}")
        tally.bytes = total
        tally.add_samples(shards.samples, shards.tokens)

    return run


def build_methods(shards: ShardSet, server: FileServer, opts: argparse.Namespace) -> list[Method]:
    skip = common.missing("mixer", "Source", "Mixture", "TokenBudget", "make_loader") or common.missing(
        "mixer.storage", "ReadAhead", "IOOptions"
    )
    local = [s.pattern for s in shards.sources]
    remote = [server.pattern(s.pattern) for s in shards.sources]
    slow = [server.pattern(s.pattern, slow=True) for s in shards.sources]
    note = f"TokenBudget({MAX_TOKENS}); stop=all_exhausted; num_workers=0"
    table = {
        "local": Method("local", "mixer, local files", one_pass(shards, local, None), skip=skip, note=note),
        "http": Method(
            "http",
            "mixer, loopback HTTP (read_ahead=2)",
            one_pass(shards, remote, {"read_ahead": 2}),
            skip=skip,
            note=note,
        ),
        "http_no_ahead": Method(
            "http_no_ahead",
            "mixer, loopback HTTP (read_ahead=0)",
            one_pass(shards, remote, {"read_ahead": 0}),
            skip=skip,
            note=note,
        ),
        "http_ttfb": Method(
            "http_ttfb",
            f"mixer, HTTP + {TTFB_MS} ms TTFB (read_ahead=2)",
            one_pass(shards, slow, {"read_ahead": 2}),
            skip=skip,
            note=note,
        ),
        "http_ttfb_no_ahead": Method(
            "http_ttfb_no_ahead",
            f"mixer, HTTP + {TTFB_MS} ms TTFB (read_ahead=0)",
            one_pass(shards, slow, {"read_ahead": 0}),
            skip=skip,
            note=note,
        ),
        "http_raw": Method(
            "http_raw", "raw byte read over HTTP (ceiling)", raw_http(shards, server), kind="raw", skip=skip
        ),
    }
    return common.select_methods("remote", table, opts.methods or list(METHODS))


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    shards = common.prepare(opts, log)
    server = FileServer(shards.root)
    try:
        methods = build_methods(shards, server, opts)
        outcomes = common.run_rounds(methods, opts.rounds, shards.weights, opts.window_tokens, log)
    finally:
        server.close()
    rows = [common.summarize(NAME, outcomes[m.name], shards) for m in methods]
    get = outcomes.get
    checks = [
        common.ratio_check(
            NAME, "mixer over loopback HTTP / local disk, real tokens/s", get("http"), get("local"), "tokens_per_s", 0.8
        ),
        common.ratio_check(
            NAME,
            "mixer over loopback HTTP / local disk, real tokens per CPU-s",
            get("http"),
            get("local"),
            "tokens_per_cpu_s",
            None,
        ),
        common.ratio_check(
            NAME,
            "HTTP read_ahead=2 / read_ahead=0, real tokens/s",
            get("http"),
            get("http_no_ahead"),
            "tokens_per_s",
            None,
        ),
        common.ratio_check(
            NAME,
            f"HTTP + {TTFB_MS} ms TTFB / local disk, real tokens/s",
            get("http_ttfb"),
            get("local"),
            "tokens_per_s",
            None,
        ),
        common.ratio_check(
            NAME,
            f"HTTP + {TTFB_MS} ms TTFB, read_ahead=2 / read_ahead=0, real tokens/s",
            get("http_ttfb"),
            get("http_ttfb_no_ahead"),
            "tokens_per_s",
            None,
        ),
        common.ratio_check(
            NAME, "mixer over HTTP / raw HTTP read, samples/s", get("http"), get("http_raw"), "samples_per_s", None
        ),
    ]
    config = {
        "profile": opts.profile,
        "rounds": opts.rounds,
        "targets": shards.weights.tolist(),
        "sources": [
            {
                "name": s.name,
                "weight": s.weight,
                "samples": s.samples,
                "tokens": s.tokens,
                "shards": len(s.urls),
                "bytes": s.bytes,
            }
            for s in shards.sources
        ],
        "shards": shards.describe(),
        "server": "ThreadingHTTPServer + os.sendfile in a spawned process on 127.0.0.1",
        "ttfb_ms": TTFB_MS,
    }
    return common.BenchResult(NAME, rows, checks, config)
