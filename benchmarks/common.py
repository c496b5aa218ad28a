"""Shared pieces of the benchmark suite: cached shard sets, decoders, accounting, rounds, tables.

Nothing here is timed by itself. A benchmark builds a list of `Method`s, `run_rounds` runs them in
alternating order, and `summarize` / `ratio_check` turn the per-round `Measurement`s into table rows
and target checks. Every rate is a median over rounds and every ratio is the median of the ratios
taken inside each round, so a noisy neighbour that slows one round slows both sides of its ratio.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import math
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BENCH_DIR = REPO / ".bench"

# An integer mtime: with webdataset's default (time.time(), a float) Python's tarfile writes a PAX
# header before every member, which makes token shards ~1.7x larger and ~2x slower to read.
MTIME = 1_700_000_000
MANIFEST_VERSION = 1
VOCAB = 50_257


# --------------------------------------------------------------------------------------------------
# shard sets


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One synthetic source: lognormal token lengths, clipped, written as `tokens.npy` (int32)."""

    name: str
    weight: float
    median: float
    sigma: float
    shards: int
    min_len: int = 16
    max_len: int = 32_768

    @property
    def mean_length(self) -> float:
        """Mean of the unclipped lognormal; used only to size the source."""
        return self.median * math.exp(self.sigma**2 / 2)


# web: many short samples; code: longer with a long tail; books: few, long. Weights are token shares,
# and each source holds that share of the tokens, so one pass over everything is the target mixture.
SOURCES = (
    SourceSpec("web", 0.6, median=250, sigma=0.8, shards=16),
    SourceSpec("code", 0.3, median=600, sigma=1.1, shards=8),
    SourceSpec("books", 0.1, median=6000, sigma=0.5, shards=4),
)
# total tokens over all sources; "full" is ~200k samples, ~400 MB of shards
PROFILES = {"full": 100_000_000, "quick": 2_000_000}


@dataclasses.dataclass(frozen=True)
class ShardSource:
    name: str
    weight: float
    pattern: str  # brace pattern over the shard paths, as a user passes it to webdataset or mixer
    urls: tuple[str, ...]
    samples: int
    tokens: int
    bytes: int

    @property
    def mean_length(self) -> float:
        return self.tokens / max(self.samples, 1)


@dataclasses.dataclass(frozen=True)
class ShardSet:
    profile: str
    root: Path
    sources: tuple[ShardSource, ...]

    @property
    def urls(self) -> list[str]:
        return [u for s in self.sources for u in s.urls]

    @property
    def weights(self) -> np.ndarray:
        w = np.array([s.weight for s in self.sources], dtype=np.float64)
        return w / w.sum()

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.sources)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sources)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.sources)

    def describe(self) -> str:
        parts = [
            f"{s.name} {s.samples:,} samples / {s.tokens / 1e6:.1f}M tok / {len(s.urls)} shards"
            f" (mean len {s.mean_length:.0f})"
            for s in self.sources
        ]
        return f"{self.profile}: " + "; ".join(parts) + f"; {self.bytes / 1e6:.0f} MB"


def _spec_dict(profile: str) -> dict[str, Any]:
    return {
        "version": MANIFEST_VERSION,
        "profile": profile,
        "total_tokens": PROFILES[profile],
        "mtime": MTIME,
        "sources": [dataclasses.asdict(s) for s in SOURCES],
    }


def ensure_shards(
    profile: str, bench_dir: Path = DEFAULT_BENCH_DIR, log: Callable[[str], None] | None = None
) -> ShardSet:
    """The cached shard set for `profile` under `bench_dir/shards/<profile>`, written on first use.

    The cache is reused when its manifest records the same spec and every shard has its recorded size.
    """
    root = Path(bench_dir) / "shards" / profile
    spec = _spec_dict(profile)
    manifest_path = root / "manifest.json"
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
            if manifest["spec"] == spec and all(
                (root / f).is_file() and (root / f).stat().st_size == size
                for src in manifest["sources"]
                for f, size in zip(src["files"], src["file_bytes"])
            ):
                return _load(profile, root, manifest)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if log:
        log(f"writing {profile} benchmark shards to {root} (once) ...")
    t0 = time.perf_counter()
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sources = [_write_source(tmp, spec_, PROFILES[profile], seed=i) for i, spec_ in enumerate(SOURCES)]
    manifest = {"spec": spec, "sources": sources}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    if log:
        log(f"wrote {sum(s['samples'] for s in sources):,} samples in {time.perf_counter() - t0:.1f} s")
    return _load(profile, root, manifest)


def _write_source(folder: Path, spec: SourceSpec, total_tokens: int, seed: int) -> dict[str, Any]:
    import webdataset as wds

    rng = np.random.default_rng([20240601, seed])
    n = max(spec.shards, round(spec.weight * total_tokens / spec.mean_length))
    lengths = np.clip(
        np.rint(rng.lognormal(math.log(spec.median), spec.sigma, size=n)), spec.min_len, spec.max_len
    ).astype(np.int64)
    tokens = rng.integers(1, VOCAB, size=int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    per_shard = math.ceil(n / spec.shards)
    pattern = str(folder / f"{spec.name}-%06d.tar")
    # ShardWriter's default encoder writes an ndarray under a ".npy" extension with np.save's format
    with wds.ShardWriter(pattern, maxcount=per_shard, maxsize=1e15, verbose=0, mtime=MTIME) as sink:
        for i in range(n):
            sink.write({"__key__": f"{spec.name}-{i:08d}", "tokens.npy": tokens[offsets[i] : offsets[i + 1]]})
    files = sorted(p.name for p in folder.glob(f"{spec.name}-*.tar"))
    with open(folder / files[0], "rb") as f:
        typeflag = f.read(512)[156:157]
    if typeflag != b"0":  # "x" would be a PAX header: the integer mtime did not take
        raise RuntimeError(f"{files[0]}: first member has tar typeflag {typeflag!r}, expected b'0'")
    return {
        "name": spec.name,
        "weight": spec.weight,
        "files": files,
        "file_bytes": [(folder / f).stat().st_size for f in files],
        "samples": n,
        "tokens": int(lengths.sum()),
    }


def _load(profile: str, root: Path, manifest: dict[str, Any]) -> ShardSet:
    sources = []
    for src in manifest["sources"]:
        files = src["files"]
        last = len(files) - 1
        pattern = str(root / f"{src['name']}-{{{0:06d}..{last:06d}}}.tar") if last else str(root / files[0])
        sources.append(
            ShardSource(
                name=src["name"],
                weight=src["weight"],
                pattern=pattern,
                urls=tuple(str(root / f) for f in files),
                samples=src["samples"],
                tokens=src["tokens"],
                bytes=sum(src["file_bytes"]),
            )
        )
    return ShardSet(profile=profile, root=root, sources=tuple(sources))


def warm_page_cache(shards: ShardSet) -> int:
    """Read every shard once so that the first timed method does not pay for a cold cache."""
    total = 0
    buf = bytearray(1 << 20)
    for url in shards.urls:
        with open(url, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


# --------------------------------------------------------------------------------------------------
# decoders for the webdataset baselines (the mixer's reader uses its own)

_NPY_DTYPES: dict[bytes, np.dtype] = {}


def npy_frombuffer(data: bytes) -> np.ndarray:
    """A 1-D C-order `.npy` payload as a read-only array view: parse the header, then `np.frombuffer`.

    This is the cheap decode (~1-2 µs); `np.load(io.BytesIO(data))` costs ~25 µs per call here.
    """
    if data[6] == 1:  # format 1.0: 2-byte header length; 2.0 and 3.0: 4 bytes
        start = 10 + (data[8] | data[9] << 8)
        header = data[10:start]
    else:
        start = 12 + int.from_bytes(data[8:12], "little")
        header = data[12:start]
    i = header.index(b"'descr': '") + 10
    descr = header[i : header.index(b"'", i)]
    dtype = _NPY_DTYPES.get(descr)
    if dtype is None:
        dtype = _NPY_DTYPES[descr] = np.dtype(descr.decode("ascii"))
    if b"'fortran_order': False" not in header:
        raise ValueError("npy_frombuffer: only C-order arrays are supported")
    return np.frombuffer(data, dtype=dtype, offset=start)


def npy_load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data))


DECODERS: dict[str, Callable[[bytes], np.ndarray]] = {"frombuffer": npy_frombuffer, "np.load": npy_load}


# --------------------------------------------------------------------------------------------------
# accounting and timing


def cpu_seconds() -> float:
    """User+system CPU of this process and of every child it has waited for (DataLoader workers)."""
    return sum(cpu_split())


def cpu_split() -> tuple[float, float]:
    """(this process, the children it has waited for): user+system CPU seconds of each."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


def reap_children(timeout: float = 60.0) -> int:
    """Join finished child processes (so their CPU shows in RUSAGE_CHILDREN); returns how many live on."""
    deadline = time.monotonic() + timeout
    while (alive := multiprocessing.active_children()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(alive)


def peak_rss(pid: int | str = "self") -> int | None:
    """Peak resident set (VmHWM) of a process in bytes; None where /proc cannot tell. A forked
    worker's figure includes the pages it shares with the main process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    """Restart this process's VmHWM from its current RSS (Linux >= 4.0), so each method gets its own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def record_worker_rss(tally: Tally) -> None:
    """Note the peak RSS of every live child process (call while the DataLoader workers still run)."""
    for child in multiprocessing.active_children():
        rss = peak_rss(child.pid) if child.pid is not None else None
        if rss is not None:
            tally.worker_rss.append(rss)


class Tally:
    """What one method delivered: samples, real tokens, padded slots, token share per source.

    Windowed share error: consecutive batches are grouped into windows of at least `window_tokens`
    real tokens, and the worst |realized - target| share over all windows and sources is kept.
    """

    def __init__(self, targets: np.ndarray, window_tokens: int) -> None:
        self.targets = np.asarray(targets, dtype=np.float64)
        self.window_tokens = window_tokens
        self.samples = 0
        self.tokens = 0
        self.slots = 0
        self.batches = 0
        self.bytes = 0
        self.per_source = np.zeros(len(self.targets), dtype=np.float64)
        self.window = np.zeros(len(self.targets), dtype=np.float64)
        self.windows = 0
        self.window_err = 0.0
        self.first_batch_s: float | None = None
        self.notes: list[str] = []
        self.worker_rss: list[int] = []
        self.t0 = time.perf_counter()

    def add_samples(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens

    def add_batch(self, lengths: np.ndarray, source: np.ndarray | None, slots: int) -> None:
        if self.first_batch_s is None:
            self.first_batch_s = time.perf_counter() - self.t0
        self.batches += 1
        self.samples += len(lengths)
        self.tokens += int(lengths.sum())
        self.slots += slots
        if source is not None:
            per = np.bincount(source, weights=lengths, minlength=len(self.targets))
            self.per_source += per
            self.window += per
            total = self.window.sum()
            if total >= self.window_tokens:
                self.window_err = max(self.window_err, float(np.abs(self.window / total - self.targets).max()))
                self.windows += 1
                self.window[:] = 0

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


@dataclasses.dataclass
class Measurement:
    wall_s: float
    cpu_s: float
    samples: int
    tokens: int
    slots: int
    batches: int
    bytes: int
    per_source: list[float]
    windows: int
    window_err: float
    first_batch_s: float | None
    notes: list[str]
    peak_rss: int | None = None  # main process, bytes
    main_cpu_s: float | None = None  # the part of cpu_s spent in this process (the rest: its children)
    worker_rss: list[int] = dataclasses.field(default_factory=list)  # each worker's peak, bytes

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def samples_per_cpu_s(self) -> float:
        return self.samples / self.cpu_s if self.cpu_s > 0 else math.nan

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s if self.cpu_s > 0 else math.nan

    @property
    def cpu_us_per_sample(self) -> float:
        return 1e6 * self.cpu_s / self.samples if self.samples else math.nan

    @property
    def pad_eff(self) -> float:
        return self.tokens / self.slots if self.slots else math.nan


@dataclasses.dataclass
class Method:
    """One thing to time. `run(tally)` does the work; `skip` (a reason) keeps it out of the rounds."""

    name: str
    label: str
    run: Callable[[Tally], None]
    kind: str = "batched"  # "read" (no batches, no mixing), "raw", or "batched"
    skip: str | None = None
    note: str = ""


@dataclasses.dataclass
class Outcome:
    method: Method
    rounds: list[Measurement | None]  # None: not run in that round (an earlier round failed)
    error: str | None = None


def measure(method: Method, targets: np.ndarray, window_tokens: int) -> Measurement:
    gc.collect()
    reset_peak_rss()
    tally = Tally(targets, window_tokens)
    m0, c0 = cpu_split()
    t0 = time.perf_counter()
    tally.t0 = t0
    method.run(tally)
    wall = time.perf_counter() - t0
    m1, c1 = cpu_split()
    cpu = (m1 - m0) + (c1 - c0)
    return Measurement(
        wall_s=wall,
        cpu_s=cpu,
        main_cpu_s=m1 - m0,
        samples=tally.samples,
        tokens=tally.tokens,
        slots=tally.slots,
        batches=tally.batches,
        bytes=tally.bytes,
        per_source=tally.per_source.tolist(),
        windows=tally.windows,
        window_err=tally.window_err,
        first_batch_s=tally.first_batch_s,
        notes=tally.notes,
        peak_rss=peak_rss(),
        worker_rss=tally.worker_rss,
    )


def run_rounds(
    methods: Sequence[Method],
    rounds: int,
    targets: np.ndarray,
    window_tokens: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, Outcome]:
    """Run every runnable method once per round; the order rotates by one method each round.

    A method that raises is reported with its error and not run again.
    """
    outcomes = {m.name: Outcome(m, []) for m in methods}
    active = [m for m in methods if m.skip is None]
    for r in range(rounds):
        k = r % len(active) if active else 0
        for m in active[k:] + active[:k]:
            out = outcomes[m.name]
            if out.error is not None:
                continue
            try:
                res = measure(m, targets, window_tokens)
            except Exception as exc:  # reported in the table; the suite then exits non-zero
                out.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                if log:
                    log(f"round {r + 1}/{rounds} {m.name}: FAILED\n{traceback.format_exc()}")
                continue
            out.rounds.append(res)
            if log:
                log(
                    f"round {r + 1}/{rounds} {m.name:22s} {res.wall_s:6.2f} s wall {res.cpu_s:6.2f} s cpu"
                    f" {res.samples_per_s:10,.0f} samples/s {res.tokens_per_s / 1e6:8.2f} Mtok/s"
                )
        for name, out in outcomes.items():
            if out.method.skip is None and out.error is None and len(out.rounds) < r + 1:
                out.rounds.append(None)  # keep rounds aligned for per-round ratios
    return outcomes


# --------------------------------------------------------------------------------------------------
# summaries, checks, output


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarize(bench: str, outcome: Outcome, shards: ShardSet) -> dict[str, Any]:
    """One table row: medians over rounds; share figures from the last round."""
    m = outcome.method
    runs = [r for r in outcome.rounds if r is not None]
    row: dict[str, Any] = {"bench": bench, "method": m.name, "label": m.label, "kind": m.kind}
    notes = [m.note] if m.note else []
    if m.skip is not None:
        row["status"] = "skipped"
        row["note"] = "; ".join(notes + [f"skipped: {m.skip}"])
        return row
    if outcome.error is not None:
        notes.append(f"ERROR: {outcome.error}")
    row["status"] = "error" if outcome.error else "ok"
    if runs:
        last = runs[-1]
        row.update(
            rounds=len(runs),
            samples_per_s=_median([r.samples_per_s for r in runs]),
            tokens_per_s=_median([r.tokens_per_s for r in runs]),
            cpu_us_per_sample=_median([r.cpu_us_per_sample for r in runs]),
            wall_s=_median([r.wall_s for r in runs]),
            cpu_s=_median([r.cpu_s for r in runs]),
            samples=last.samples,
            tokens=last.tokens,
            peak_rss_mb=_median([r.peak_rss / 1e6 for r in runs if r.peak_rss is not None]),
            worker_rss_mb=_median([max(r.worker_rss) / 1e6 for r in runs if r.worker_rss]),
            per_round=[dataclasses.asdict(r) if r else None for r in outcome.rounds],
        )
        if m.kind == "raw":
            row["bytes_per_s"] = _median([r.bytes / r.wall_s for r in runs])
            notes.append(f"{row['bytes_per_s'] / 1e6:,.0f} MB/s; samples/s = all samples / read time")
        if m.kind == "batched":
            row["pad_eff"] = _median([r.pad_eff for r in runs])
            row["first_batch_ms"] = _median([1e3 * r.first_batch_s for r in runs if r.first_batch_s is not None])
            per = np.asarray(last.per_source)
            if per.sum() > 0:
                share = per / per.sum()
                row["share"] = share.tolist()
                row["share_err"] = float(np.abs(share - shards.weights).max())
                if all(r.windows for r in runs):
                    row["window_err"] = max(r.window_err for r in runs)
                    row["windows"] = last.windows
        for r in runs:
            notes.extend(n for n in r.notes if n not in notes)
    row["note"] = "; ".join(notes)
    return row


def per_round(outcome: Outcome | None, attr: str) -> list[float | None]:
    if outcome is None or outcome.method.skip is not None:
        return []
    return [getattr(r, attr) if r is not None else None for r in outcome.rounds]


def ratio_check(
    bench: str,
    name: str,
    num: Outcome | None,
    den: Outcome | None,
    attr: str,
    target: float | None,
    op: str = ">=",
) -> dict[str, Any]:
    """Median over rounds of num.attr / den.attr, both measured in that round."""
    a, b = per_round(num, attr), per_round(den, attr)
    ratios = [x / y for x, y in zip(a, b) if x is not None and y is not None and y > 0]
    return _check(bench, name, _median(ratios) if ratios else math.nan, target, op, per_round=ratios)


def values_check(
    bench: str, name: str, values: Sequence[float], target: float | None, op: str = ">="
) -> dict[str, Any]:
    """Median of a figure computed inside each round (the rounds' values are kept beside it)."""
    return _check(bench, name, _median(values) if values else math.nan, target, op, per_round=list(values))


def value_check(bench: str, name: str, value: float | None, target: float | None, op: str = ">=") -> dict[str, Any]:
    return _check(bench, name, math.nan if value is None else value, target, op)


def _check(bench: str, name: str, value: float, target: float | None, op: str, **extra: Any) -> dict[str, Any]:
    if math.isnan(value):
        result = "n/a"
    elif target is None:
        result = "info"
    else:
        ok = value >= target if op == ">=" else value <= target
        result = "PASS" if ok else "MISS"
    return {"bench": bench, "check": name, "value": value, "target": target, "op": op, "result": result, **extra}


@dataclasses.dataclass
class BenchResult:
    name: str
    rows: list[dict[str, Any]]
    checks: list[dict[str, Any]]
    config: dict[str, Any]

    @property
    def failed(self) -> bool:
        return any(r.get("status") == "error" for r in self.rows)


def machine_info() -> dict[str, Any]:
    import torch
    import webdataset

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": affinity,
        "loadavg": os.getloadavg(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "webdataset": getattr(webdataset, "__version__", "?"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"name": result.name, "config": result.config, "rows": result.rows, "checks": result.checks}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_json_default, allow_nan=True))
    os.replace(tmp, path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


def fmt_si(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g}{suffix}"
    return f"{x:.{digits}g}"


def _fmt(x: float | None, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, spec)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(cell: str) -> str:
        return str(cell).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def rows_table(results: Sequence[BenchResult]) -> str:
    header = [
        "bench",
        "method",
        "samples/s",
        "real tok/s",
        "pad eff",
        "token share (target)",
        "share err",
        "worst window err",
        "CPU-µs/sample",
        "1st batch ms",
        "peak RSS MB main / worker",
        "wall s",
        "note",
    ]
    body = []
    for res in results:
        targets = res.config.get("targets")
        for r in res.rows:
            share = r.get("share")
            share_txt = "—"
            if share is not None:
                share_txt = "/".join(f"{s:.3f}" for s in share)
                if targets:
                    share_txt += " (" + "/".join(f"{t:.2f}" for t in targets) + ")"
            body.append(
                [
                    res.name,
                    r["label"],
                    fmt_si(r.get("samples_per_s")),
                    fmt_si(r.get("tokens_per_s")),
                    _fmt(r.get("pad_eff"), ".3f"),
                    share_txt,
                    _fmt(r.get("share_err"), ".4f"),
                    _fmt(r.get("window_err"), ".4f"),
                    _fmt(r.get("cpu_us_per_sample"), ".1f"),
                    _fmt(r.get("first_batch_ms"), ".0f"),
                    _fmt(r.get("peak_rss_mb"), ".0f") + " / " + _fmt(r.get("worker_rss_mb"), ".0f"),
                    _fmt(r.get("wall_s"), ".2f"),
                    r.get("note", ""),
                ]
            )
    return markdown_table(header, body)


def checks_table(results: Sequence[BenchResult]) -> str:
    body = []
    for res in results:
        for c in res.checks:
            target = "—" if c["target"] is None else f"{c['op']} {c['target']:g}"
            per = c.get("per_round")
            value = _fmt(c["value"], ".3f")
            if per and len(per) > 1:
                value += " (rounds: " + ", ".join(f"{p:.2f}" for p in per) + ")"
            body.append([res.name, c["check"], value, target, c["result"]])
    return markdown_table(["bench", "check", "value (median of per-round)", "target", "result"], body)


# --------------------------------------------------------------------------------------------------
# the mixer's public API, which may be partly written when a benchmark runs


def missing(module: str, *names: str) -> str | None:
    """None when `module` imports and has every name; else why not (for a 'skipped' row)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return f"`{module}` not importable yet ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    absent = [n for n in names if not hasattr(mod, n)]
    if absent:
        return f"`{module}` has no {', '.join(absent)} yet"
    return None


def prepare(opts: Any, log: Callable[[str], None]) -> Any:
    """The shard set of this run, described in the log and warm in the page cache."""
    shards = ensure_shards(opts.profile, opts.bench_dir, log)
    log(shards.describe())
    warm_page_cache(shards)
    return shards


def select_methods(bench: str, table: dict[str, Any], names: list[str] | None) -> list[Any]:
    """The methods asked for with ``--methods`` (default: all, in table order); an unknown name stops the run."""
    names = names or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"{bench}: unknown method(s) {unknown}; choose from {list(table)}")
    return [table[n] for n in names]


def standalone(
    name: str,
    parser: Any,
    run: Callable[[Any, Callable[[str], None]], BenchResult],
    argv: list[str] | None,
    tables: Sequence[str] = ("table",),
) -> int:
    """``python -m benchmarks.NAME``: parse, run with a timestamped log on stderr, write
    ``<bench-dir>/NAME[.quick].json``, print the benchmark's tables (keys of its config) and checks;
    the exit status says whether a check missed. ``parser`` must define ``--quick`` and ``--bench-dir``."""
    opts = parser.parse_args(argv)
    opts.profile = "quick" if opts.quick else "full"
    res = run(opts, lambda m: print(f"[{name} {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True))
    write_json(res, opts.bench_dir / f"{name}{'.quick' if opts.quick else ''}.json")
    for key in tables:
        print(res.config[key])
        print()
    print(checks_table([res]))
    return 1 if res.failed else 0
