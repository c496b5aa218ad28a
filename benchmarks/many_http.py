"""The loopback HTTP server of `benchmarks.many_sources`: in its own process, it counts the body bytes
it sends, the GETs it answers and its connections, honours ranges with an end byte, and answers paths
under ``ttfb/`` after ``TTFB_MS`` (an object store's time to first byte; loopback has none)."""

from __future__ import annotations

import contextlib
import multiprocessing
import re
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TTFB_MS = 50
SLOW = "ttfb/"  # a path prefix the server answers after TTFB_MS


def served_path(handler: BaseHTTPRequestHandler, root: Path) -> Path | None:
    """The file under ``root`` a GET asks for, after ``TTFB_MS`` when under ``SLOW`` (an object
    store's first byte); None when there is none, once a 404 has been sent."""
    rel = urllib.parse.unquote(urllib.parse.urlsplit(handler.path).path).lstrip("/")
    if rel.startswith(SLOW):
        rel = rel[len(SLOW) :]
        time.sleep(TTFB_MS / 1000)
    path = (root / rel).resolve()
    if root not in path.parents or not path.is_file():
        handler.send_response(404)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
        return None
    return path


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path
    sent: Any  # multiprocessing.Value
    gets: Any
    conns: Any
    peak: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.conns.get_lock():
            self.conns.value += 1
            self.peak.value = max(self.peak.value, self.conns.value)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        with self.conns.get_lock():
            self.conns.value -= 1

    def do_GET(self) -> None:
        path = served_path(self, self.root)
        if path is None:
            return
        data = path.read_bytes()
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        start = int(m.group(1)) if m else 0
        stop = min(int(m.group(2)) + 1, len(data)) if m and m.group(2) else len(data)
        if start >= len(data) and m:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with self.gets.get_lock():
            self.gets.value += 1
        self.send_response(206 if m else 200)
        self.send_header("Content-Length", str(stop - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{len(data)}"')
        if m:
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(data)}")
        if self.headers.get("Connection", "").lower() == "close":
            self.send_header("Connection", "close")
        self.end_headers()
        view = memoryview(data)[start:stop]
        try:
            for i in range(0, len(view), 65536):
                chunk = view[i : i + 65536]
                self.wfile.write(chunk)
                with self.sent.get_lock():
                    self.sent.value += len(chunk)
        except OSError:
            self.close_connection = True


def _serve(root: str, conn: Any, counters: tuple[Any, ...]) -> None:
    sent, gets, conns, peak = counters
    handler = type(
        "Handler", (_Handler,), {"root": Path(root).resolve(), "sent": sent, "gets": gets, "conns": conns, "peak": peak}
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.request_queue_size = 1024
    conn.send(server.server_address[1])
    server.serve_forever(poll_interval=0.1)


@contextlib.contextmanager
def counting_server(root: Path) -> Iterator[tuple[int, tuple[Any, ...]]]:
    ctx = multiprocessing.get_context("spawn")
    counters = (ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0))
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(str(root), child, counters), daemon=True, name="bench-many-http")
    process.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the benchmark HTTP server did not start within 60 s")
        yield int(parent.recv()), counters
    finally:
        process.terminate()
        process.join(10)
