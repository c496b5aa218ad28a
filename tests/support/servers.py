"""Real servers on 127.0.0.1 for the I/O tests: a range-capable HTTP file server that injects faults on
demand, and moto's S3 server in-process. Plain context managers; the tests' fixtures start and stop them.

Nothing here listens on anything but 127.0.0.1 (port 0: the kernel picks a free port), and leaving a
``with`` block stops the server and every thread it started.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import logging
import os
import posixpath
import select
import socket
import struct
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import pytest


def free_port() -> int:
    """A port on 127.0.0.1 free right now, for a server another process starts (torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------------------- HTTP


@dataclass(frozen=True)
class Request:
    """One request as the server saw it. ``start``/``end`` are the parsed ``Range: bytes=start-end``
    (``end`` inclusive, None when open-ended); both None when the request had no Range header."""

    method: str
    path: str
    start: int | None
    end: int | None
    headers: Mapping[str, str]
    status: int = 0
    fault: str = ""
    """The injected fault this request was served (see `Fault`): ``"status 503"``, ``"reset"``, ``"close"``,
    ``"stall"``, ``"hang"``, ``"ignore_range"`` (only when it changed the answer: a Range was asked); ""
    when none. Tests compare a client's retry count with these, not with what timing suggests."""
    version: str = ""
    """The broken version of the file it was answered from (``"truncate"``, ``"corrupt"``, ``"replace"``);
    "" for the file itself."""
    listing: bool = False
    """A GET of a folder, answered with its HTML listing: what an object store's LIST is to a client."""

    @property
    def retriable(self) -> bool:
        """Whether the fault served is one a client retries: a 5xx, 408, 425 or 429, or a response cut,
        stalled or never answered (as `mixer.storage.faults.classify` has it)."""
        if self.fault.startswith("status "):
            code = int(self.fault.split()[1])
            return code >= 500 or code in (408, 425, 429)
        return self.fault in ("reset", "close", "stall", "hang")


class Resends(NamedTuple):
    """How a stream's GETs of one path followed one another, as the server saw them (`resends`)."""

    after_fault: int  # GETs that re-asked after a retriable fault: the retries the faults called for
    after_healthy: int  # GETs that re-asked after an answer that needed none (a timeout on a slow but healthy response)


def resends(gets: Sequence[Request]) -> Resends:
    """Count the GETs after the first of one stream's GETs (in order), each by what the previous one
    was served. A client that re-asks only to retry, as a stream with no pool pressure does, then
    made exactly ``after_fault + after_healthy`` retries: the count its stats must report, taken
    from what the server served instead of from the wall clock. ``after_healthy`` is not 0 only when
    a client gave up on a healthy answer (under load, with a read timeout short enough to catch a
    stall), and the server saw that too."""
    after_fault = sum(1 for prev in gets[:-1] if prev.retriable)
    return Resends(after_fault, max(len(gets) - 1, 0) - after_fault)


@dataclass
class Fault:
    """A fault for the next ``times`` GET requests of one path (``times=None``: every request).

    kind: ``"status"`` (answer ``status`` with no body), ``"reset"`` (send the headers and ``after``
    bytes of the body, then reset the connection with an RST), ``"close"`` (same, but a clean FIN:
    an incomplete body), ``"stall"`` (send ``after`` body bytes, then go silent for ``seconds`` and
    close), ``"hang"`` (read the request, answer nothing for ``seconds``, close), ``"ignore_range"``
    (answer 200 with the whole file even to a Range request). ``pause`` seconds pass between the
    ``after`` bytes and the reset / close, so that the client has received them (a reset makes the
    client's kernel drop whatever it has not yet handed to the client). ``head=True`` lets HEAD
    requests consume (and suffer) the fault too. Each request that is served a fault records it
    (`Request.fault`).
    """

    kind: str
    times: int | None = 1
    status: int = 503
    after: int = 0
    seconds: float = 5.0
    pause: float = 0.0
    headers: Mapping[str, str] = field(default_factory=dict)
    head: bool = False


class FaultyHTTPServer:
    """A threaded HTTP/1.1 file server for ``root`` with correct single-range support (206 with
    Content-Range, 416 when unsatisfiable, Accept-Ranges, strong ETags and If-Match, HEAD with
    Content-Length, HTML listings of folders) and faults injected per path on demand.

    Faults are queued per path and consumed in order, one per GET (HEAD only with ``head=True``),
    so ``fail("a.tar", "status", times=2)`` then a normal request gives 503, 503, 200. A path can also
    be served as a different *version* of its file (``truncate`` / ``corrupt`` / ``replace``), which
    changes its bytes, Content-Length and ETag consistently: the server is then honestly serving a
    broken file. Every request is recorded (``requests(path)``) so tests can assert that retries and
    ranged resumes happened, and from which byte; each records the fault or broken version it was
    served (``served(path)``), so that a test counts the faults that really reached a client.
    """

    def __init__(self, root: str | os.PathLike[str], *, count_connections: bool = False) -> None:
        self.root = Path(root).resolve()
        # With count_connections a connection counts from accept until the client closes it (the
        # handler waits for the client's FIN after answering): ``peak_connections`` is then the most
        # connections the clients held open at once, whatever the kernel buffered for them.
        self.count_connections = count_connections
        self.open_connections = 0
        self.peak_connections = 0
        self._lock = threading.Lock()
        self._faults: dict[str, list[Fault]] = {}
        self._versions: dict[str, tuple[bytes, str]] = {}  # path: (content, "truncate" / "corrupt" / "replace")
        self._log: list[Request] = []
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._counted: set[socket.socket] = set()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.delay = 0.0  # seconds every GET waits before it is answered (an object store's time to first byte)
        self.peak = 0  # the most GETs in flight at once since the last clear()
        self._inflight = 0

    # ----------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> FaultyHTTPServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"owner": self})
        server = _Server(("127.0.0.1", 0), handler)
        server.daemon_threads = False  # server_close() joins every handler thread
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="faulty-http")
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._stop.set()  # wakes stalled handlers
        self._server.shutdown()
        assert self._thread is not None
        self._thread.join()
        with self._lock:  # keep-alive handlers block reading the next request: cut them loose
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server.server_close()
        self._server = None

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return int(self._server.server_address[1])

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}"

    # ----------------------------------------------------------------------------- faults
    def fail(self, path: str, kind: str = "status", **kwargs: Any) -> None:
        """Queue a `Fault` for ``path`` (relative to root, no leading slash)."""
        if kind not in {"status", "reset", "close", "stall", "hang", "ignore_range"}:
            raise ValueError(f"unknown fault kind {kind!r}")
        with self._lock:
            self._faults.setdefault(_norm(path), []).append(Fault(kind, **kwargs))

    def truncate(self, path: str, size: int) -> None:
        """Serve only the first ``size`` bytes of ``path`` from now on."""
        self._replace(path, self._read(path)[0][:size], "truncate")

    def corrupt(self, path: str, offset: int, data: bytes = b"\xff" * 8) -> None:
        """Serve ``path`` with ``data`` written over its bytes at ``offset``."""
        content = bytearray(self._read(path)[0])
        content[offset : offset + len(data)] = data
        self._replace(path, bytes(content), "corrupt")

    def replace(self, path: str, content: bytes) -> None:
        """Serve ``content`` as ``path`` from now on (a new version of the file: another ETag)."""
        self._replace(path, content, "replace")

    def _replace(self, path: str, content: bytes, kind: str) -> None:
        with self._lock:
            self._versions[_norm(path)] = (content, kind)

    def clear(self) -> None:
        """Forget faults, versions, the request log and the peak of GETs in flight."""
        with self._lock:
            self._faults.clear()
            self._versions.clear()
            self._log.clear()
            self.peak = 0

    def served(self, path: str | None = None, method: str | None = "GET") -> list[Request]:
        """The requests (GETs unless ``method`` says otherwise; None: all) that were served an injected
        fault or a broken version, in order: what the clients really met, whatever their timing."""
        return [r for r in self.requests(path, method) if r.fault or r.version]

    def counts(self) -> dict[str, int]:
        """Requests served so far by kind: ``LIST`` (GETs of a folder), ``HEAD`` and ``GET`` (of files)."""
        everything = self.requests(method=None)
        return {
            "LIST": sum(r.listing for r in everything),
            "HEAD": sum(r.method == "HEAD" for r in everything),
            "GET": sum(r.method == "GET" and not r.listing for r in everything),
        }

    def requests(self, path: str | None = None, method: str | None = "GET") -> list[Request]:
        with self._lock:
            return [
                r
                for r in self._log
                if (path is None or r.path == _norm(path)) and (method is None or r.method == method)
            ]

    # ----------------------------------------------------------------------------- internals
    def _read(self, path: str) -> tuple[bytes, str]:
        """The bytes served as ``path`` and which broken version they are ("" for the file itself)."""
        with self._lock:
            version = self._versions.get(_norm(path))
        if version is not None:
            return version
        return (self.root / _norm(path)).read_bytes(), ""

    def _next_fault(self, path: str, head: bool) -> Fault | None:
        with self._lock:
            queue = self._faults.get(path)
            if not queue or (head and not queue[0].head):
                return None
            fault = queue[0]
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    queue.pop(0)
            return fault

    def _record(self, request: Request) -> None:
        with self._lock:
            self._log.append(request)


def _client_closed(conn: socket.socket) -> bool:
    """Whether the client has closed its end of this connection (a FIN or an RST arrived), without
    reading and without ever waiting: `_Handler.setup` asks it of every counted connection while it
    holds the server's lock.

    Not ``recv(MSG_PEEK | MSG_DONTWAIT)``: on a socket with a timeout (the handlers' 10 s) CPython
    polls for readability before that recv, flag or not, so a peek that lost the race to the
    connection's own handler thread (``select`` saw a request, the handler read it first) waited the
    full 10 s, lock held, stalling every new connection and every GET behind it (and then counted the
    live connection closed). Nor the socket switched to non-blocking for the peek: its handler thread
    may call recv meanwhile and would get EAGAIN. ``poll`` with POLLRDHUP is one syscall with a zero
    timeout, and it reports the FIN even when a request is still unread before it.
    """
    try:
        if conn.fileno() < 0:  # the handler already closed it (a reset or stall fault)
            return True
        if _RDHUP:
            poller = select.poll()
            poller.register(conn, select.POLLIN | _RDHUP)
            events = poller.poll(0)
            return bool(events) and bool(events[0][1] & (_RDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL))
        # Without POLLRDHUP (not Linux): peek through a duplicate of the descriptor that has no
        # timeout, so that CPython calls recv straight away and MSG_DONTWAIT returns at once.
        with socket.socket(fileno=os.dup(conn.fileno())) as view:
            return view.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


_RDHUP = getattr(select, "POLLRDHUP", 0)


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # hundreds of clients may connect at once: none waits for a SYN retry


def _norm(path: str) -> str:
    return posixpath.normpath("/" + urllib.parse.unquote(path.split("?", 1)[0].split("#", 1)[0])).lstrip("/")


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """(first, last) inclusive; None when absent; "bad" when unsatisfiable or not one bytes range."""
    if header is None:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return "bad"
    first_s, _, last_s = spec.strip().partition("-")
    try:
        if first_s == "":  # suffix range: the last N bytes
            n = int(last_s)
            if n <= 0 or size == 0:
                return "bad"
            return max(size - n, 0), size - 1
        first = int(first_s)
        last = int(last_s) if last_s else size - 1
    except ValueError:
        return "bad"
    if first >= size or last < first:
        return "bad"
    return first, min(last, size - 1)


class _Handler(BaseHTTPRequestHandler):
    owner: FaultyHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = 10  # an idle keep-alive connection never holds a thread for long

    def setup(self) -> None:
        super().setup()
        owner = self.owner
        with owner._lock:
            owner._conns.add(self.connection)
            # Clients that closed a connection before opening this one: count them closed first
            # (their handler threads may not have noticed yet).
            owner._counted = {c for c in owner._counted if not _client_closed(c)}
            owner._counted.add(self.connection)
            owner.open_connections = len(owner._counted)
            owner.peak_connections = max(owner.peak_connections, owner.open_connections)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        owner = self.owner
        conn = self.connection
        if owner.count_connections:  # until the client closes its end
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)  # the server's end is closed, as without counting
                conn.settimeout(0.1)
                while not owner._stop.is_set():
                    try:
                        if not conn.recv(65536):
                            break
                    except TimeoutError:
                        continue
        with owner._lock:
            owner._conns.discard(conn)
            owner._counted.discard(conn)
            owner.open_connections = len(owner._counted)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        owner = self.owner
        with owner._lock:
            owner._inflight += 1
            owner.peak = max(owner.peak, owner._inflight)
        try:
            if owner.delay:
                owner._stop.wait(owner.delay)
            self._serve(head=False)
        finally:
            with owner._lock:
                owner._inflight -= 1

    def _serve(self, head: bool) -> None:
        owner = self.owner
        path = _norm(self.path)
        range_header = self.headers.get("Range")
        full = owner.root / path
        try:
            full.resolve().relative_to(owner.root)
        except ValueError:
            return self._status(403, path, range_header)
        if full.is_dir():
            return self._listing(path, full, head)
        try:
            content, version = owner._read(path)
        except (FileNotFoundError, IsADirectoryError):
            return self._status(404, path, range_header)

        fault = owner._next_fault(path, head)
        if fault is not None and fault.kind == "status":
            return self._status(fault.status, path, range_header, fault.headers, f"status {fault.status}", version)
        if fault is not None and fault.kind == "hang":
            self._record(path, range_header, 0, "hang", version)
            owner._stop.wait(fault.seconds)
            self.close_connection = True
            return

        size = len(content)
        etag = '"' + hashlib.md5(content).hexdigest() + '"'
        if_match = self.headers.get("If-Match")
        if if_match is not None and if_match.strip() != "*" and etag not in [t.strip() for t in if_match.split(",")]:
            return self._status(412, path, range_header, version=version)
        parsed = _parse_range(range_header, size)
        served = fault.kind if fault is not None else ""
        if fault is not None and fault.kind == "ignore_range":
            served = "ignore_range" if parsed is not None else ""  # without a Range the answer is the usual 200
            parsed = None
        if parsed == "bad":
            return self._status(416, path, range_header, {"Content-Range": f"bytes */{size}"}, version=version)
        if parsed is None:
            status, first, last = 200, 0, size - 1
        else:
            assert isinstance(parsed, tuple)
            status, (first, last) = 206, parsed
        body = content[first : last + 1]
        self._record(path, range_header, status, served, version)
        self.send_response(status)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        if self.headers.get("Connection", "").lower() == "close":
            self.send_header("Connection", "close")  # as HTTP/1.1 servers answer such a request
        if status == 206:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.end_headers()
        if head:
            return
        if fault is None or fault.kind == "ignore_range":
            self._write(body)
            return
        self._write(body[: fault.after])
        if fault.pause:
            owner._stop.wait(fault.pause)
        if fault.kind == "stall":
            owner._stop.wait(fault.seconds)
        elif fault.kind == "reset":
            # SO_LINGER with a zero timeout: close() sends an RST instead of a FIN.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.close()

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            self.wfile.write(data)
            self.wfile.flush()

    def _record(self, path: str, range_header: str | None, status: int, fault: str = "", version: str = "") -> None:
        start = end = None
        if range_header is not None and range_header.startswith("bytes="):
            first_s, _, last_s = range_header[len("bytes=") :].partition("-")
            with contextlib.suppress(ValueError):
                start = int(first_s) if first_s else None
                end = int(last_s) if last_s else None
        self.owner._record(Request(self.command, path, start, end, dict(self.headers.items()), status, fault, version))

    def _status(
        self,
        status: int,
        path: str,
        range_header: str | None,
        headers: Mapping[str, str] = {},
        fault: str = "",
        version: str = "",
    ) -> None:
        self._record(path, range_header, status, fault, version)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _listing(self, path: str, folder: Path, head: bool) -> None:
        self.owner._record(Request(self.command, path, None, None, dict(self.headers.items()), 200, listing=True))
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
        base = "/" + path.rstrip("/") + "/" if path else "/"
        links = "".join(f'<a href="{html.escape(base + urllib.parse.quote(n))}">{html.escape(n)}</a>\n' for n in names)
        body = f"<html><body>\n{links}</body></html>\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self._write(body)


# ----------------------------------------------------------------------------------------------- S3

DUMMY_KEY = "testing-key"
DUMMY_SECRET = "testing-secret"
REGION = "us-east-1"


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 in-process on 127.0.0.1 (a fresh, empty account); yields the endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log on stderr
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    _moto_reset(endpoint)
    try:
        yield endpoint
    finally:
        _moto_reset(endpoint)
        server.stop()
        inner = getattr(server, "_server", None)
        if inner is not None:
            inner.server_close()


def _moto_reset(endpoint: str) -> None:
    # moto keeps its buckets in process-global state: reset it so each server starts empty.
    request = urllib.request.Request(endpoint + "/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """What a source's ``storage_options`` would hold to reach this server with dummy credentials."""
    return {
        "endpoint_url": endpoint,
        "key": DUMMY_KEY,
        "secret": DUMMY_SECRET,
        "client_kwargs": {"region_name": REGION},
    }


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=DUMMY_KEY,
        aws_secret_access_key=DUMMY_SECRET,
        region_name=REGION,
    )


def make_bucket(endpoint: str, bucket: str, files: Mapping[str, bytes | os.PathLike[str]] = {}) -> None:
    """Create ``bucket`` and upload ``{key: bytes or local path}`` into it with boto3."""
    client = s3_client(endpoint)
    try:
        client.create_bucket(Bucket=bucket)
        for key, data in files.items():
            body = data if isinstance(data, bytes) else Path(data).read_bytes()
            client.put_object(Bucket=bucket, Key=key, Body=body)
    finally:
        client.close()


# ------------------------------------------------------------------------------------------ guards


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Fail any attempt to connect anywhere but 127.0.0.1 / ::1 (e.g. the EC2 metadata service)."""
    original_connect, original_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1"):
            raise AssertionError(f"test tried to connect to {address!r}")

    def connect(self: socket.socket, address: Any) -> None:
        check(self, address)
        return original_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        check(self, address)
        return original_connect_ex(self, address)

    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
    try:
        yield
    finally:
        socket.socket.connect, socket.socket.connect_ex = original_connect, original_connect_ex  # type: ignore[method-assign]


@contextlib.contextmanager
def no_aws_config() -> Iterator[None]:
    """No real AWS configuration may leak in (keys, profiles, endpoints, the metadata service)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    for key in saved:
        del os.environ[key]
    os.environ.update(
        {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    )
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("AWS_")]:
            del os.environ[key]
        os.environ.update(saved)


@contextlib.contextmanager
def remote_test_guard() -> Iterator[None]:
    """What a module of remote tests runs under: loopback only, no AWS configuration from the
    environment, and fsspec's cached filesystems (and their sessions) closed afterwards."""
    from mixer.storage.filesystems import close_filesystems

    with loopback_only(), no_aws_config():
        yield
    close_filesystems()


@pytest.fixture(scope="module", autouse=True)
def remote_guard() -> Iterator[None]:
    """`remote_test_guard` around a whole test module: import it into the module
    (``from servers import remote_guard  # noqa: F401``) and it applies to every test there."""
    with remote_test_guard():
        yield
