"""What a shard index costs a reader as the dataset grows: bytes on disk, load time, private memory.

For indexes of ``SIZES`` samples (``--quick``: 1e5, 1e6, 1e7; full: 1e6, 1e7, 1e8; the test
suite's ``smoke``: 1e4, 1e5) at ``PER_SHARD`` samples a shard, each built once under ``<bench-dir>/world_scale_index``:

* the index file is written by the code `mixer.build_index` writes with (``Entry.make``,
  ``encode_file``), every shard with lengths of its own (lognormal, median 300) and the offsets of
  a tar of one ``tokens.npy`` member per sample, the layout `mixer.build_index` measured on
  ``TEMPLATES`` real shards (checked); the shard files are sparse files of that size and
  modification time, so loading verifies every entry as it would (a ``stat`` each) without 1e8
  samples on disk (indexing 1e8 real samples is out of reach on a small machine);
* ``disk``: the JSON index file and its columnar twin (`mixer.plan.index_columns`);
* ``first load``: `mixer.load_index` when no twin exists yet: the JSON parsed once and the twin
  written (once per version of the index file, per node);
* ``READERS`` ranks at once (4; 2 for ``smoke``; fresh processes: the ranks of a node), each timing the index file's
  own load with its twin present (``mixer.plan.index._read``: map it; its USS growth), then the
  whole `mixer.load_index`, which also lists the shards and ``stat``-s every one of them to verify
  its entry (that part grows with the shards; its USS growth is the rank's), then reading what a
  mixture's main process reads of it (sizes, a length sample);
* ``USS per reader``: each rank forks ``WORKERS`` DataLoader-like workers that plan their part of
  epoch 0 as readers of 1,024 x 16 and decode their slices' offsets; a worker's USS growth
  (``Private_Clean + Private_Dirty`` of ``/proc/self/smaps_rollup``, after a garbage collection)
  less a reference worker's that only collects (the page copies any forked worker makes): the
  median over the workers (and the most);
* ``JSON load`` (the baseline, measured in the same run up to ``JSON_UP_TO`` samples): parsing the
  index file into an object per entry, as a load did before the twin, the rank's USS growth, and
  a forked worker's (collecting and reading the per-shard numbers from the entries).

The last two sizes are extrapolated linearly to 1e9 samples (a row marked ``extrapolated``).

``run(profile) -> rows``: one dict per size (``samples``, ``shards``, ``disk_json_mb``,
``disk_columns_mb``, ``first_load_s``, ``read_s``, ``read_uss_mb``, ``load_s``, ``rank_uss_mb``,
``uss_mb``, ``uss_max_mb``, ``json_load_s``, ``json_rank_uss_mb``, ``json_worker_uss_mb``,
``extrapolated``); ``main()`` prints them as a table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing
import os
import re
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

NAME = "world_scale_index"
PER_SHARD = 1000
TEMPLATES = 8
SIZES = {"smoke": (10**4, 10**5), "quick": (10**5, 10**6, 10**7), "full": (10**6, 10**7, 10**8)}
JSON_UP_TO = {"smoke": 10**5, "quick": 10**7, "full": 10**8}
READERS = {"smoke": 2, "quick": 4, "full": 4}  # ranks of a node loading at once (smoke: each is a fresh process)
WORKERS = 2  # DataLoader workers each rank forks
WORLD = (1024, 16)  # ranks x workers: the readers a plan is cut for
MTIME_NS = 1_700_000_000 * 10**9
DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".bench" / NAME


def _uss_mb() -> float:
    text = Path("/proc/self/smaps_rollup").read_text()
    return sum(int(kb) for kb in re.findall(r"^Private_\w+:\s+(\d+) kB", text, re.M)) / 1024


# ---- the index: templates read by build_index, entries repeated over sparse shard files ---------


def _templates(root: Path) -> list[Any]:
    """``TEMPLATES`` real shards of ``PER_SHARD`` samples (lognormal lengths, median 300), indexed by
    `mixer.build_index`; their entries."""
    import mixer

    folder = root / "templates"
    if not (folder / "mixer-index.json.gz").exists():
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        for t in range(TEMPLATES):
            with tarfile.open(folder / f"t-{t:03d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
                for j, n in enumerate(_lengths(rng)):
                    buf = io.BytesIO()
                    np.save(buf, rng.integers(1, 50_000, int(n)).astype(np.int32), allow_pickle=False)
                    info = tarfile.TarInfo(f"t{t:03d}-{j:06d}.tokens.npy")
                    info.size, info.mtime = buf.tell(), 1_700_000_000
                    buf.seek(0)
                    tar.addfile(info, buf)
    return list(mixer.build_index(str(folder / f"t-{{000..{TEMPLATES - 1:03d}}}.tar")).entries)


def _lengths(rng: np.random.Generator) -> np.ndarray:
    return np.clip(rng.lognormal(math.log(300), 0.8, PER_SHARD), 8, 8192).astype(np.int64)


def _layout(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Where each sample of a shard of one ``tokens.npy`` member per sample starts, the end of the
    archive, and the shard's size, as Python's tarfile writes it (a 512-byte header, the ``.npy``
    file of 128 header bytes and 4 bytes a token in 512-byte blocks; two zero blocks and padding
    to 10,240 bytes at the end): the offsets `mixer.build_index` measures (checked on the templates)."""
    spans = 512 + -(-(128 + 4 * lengths) // 512) * 512
    offsets = np.concatenate([[0], np.cumsum(spans)])
    return offsets, -(-(int(offsets[-1]) + 1024) // 10240) * 10240


def _pattern(folder: Path, shards: int) -> str:
    return str(folder / f"s-{{0000000..{shards - 1:07d}}}.tar")


def ensure_index(root: Path, samples: int) -> tuple[Path, str]:
    """The folder of sparse shards and its JSON index for ``samples`` samples (written once); its
    pattern. Every shard has lengths of its own (drawn as the templates', seeded by the shard), so
    the file compresses as a real one does."""
    import mixer
    from mixer.plan.index import tokens_by
    from mixer.plan.shard_index import DEFAULT_NAME, Entry, encode_file

    shards = samples // PER_SHARD
    folder = root / f"n{samples:.0e}".replace("+", "")
    done = folder / "done.json"
    if not done.exists():
        for t in _templates(root):  # the layout is the one build_index measured on real shards
            offsets, size = _layout(t.lengths())
            if not (np.array_equal(offsets, t.offsets()) and size == t.size):
                raise RuntimeError("the synthetic shard layout is not what build_index measured on the templates")
        folder.mkdir(parents=True, exist_ok=True)
        entries = {}
        for i in range(shards):
            lengths = _lengths(np.random.default_rng([1, i]))
            offsets, size = _layout(lengths)
            name = f"s-{i:07d}.tar"
            with open(folder / name, "wb") as f:
                f.truncate(size)
            os.utime(folder / name, ns=(MTIME_NS, MTIME_NS))
            entries[name] = Entry.make(size=size, validator=f"mtime:{MTIME_NS}", offsets=offsets, lengths=lengths)
        by = tokens_by(mixer.Source("x", "unused.tar"))  # the default decode's, as load_index(pattern) uses
        (folder / DEFAULT_NAME).write_bytes(encode_file(entries, by, gz=True))  # build_index's writer
        done.write_text(json.dumps({"samples": samples, "shards": shards}))
    return folder, _pattern(folder, shards)


def _twin(folder: Path) -> Path:
    from mixer.plan.index_columns import SUFFIX
    from mixer.plan.shard_index import DEFAULT_NAME

    return folder / (DEFAULT_NAME + SUFFIX)


# ---- measurements, each in fresh processes -------------------------------------------------------


def _first_load(pattern: str, twin: str, out: Any) -> None:
    import mixer

    with contextlib.suppress(FileNotFoundError):
        os.unlink(twin)
    t0 = time.perf_counter()
    mixer.load_index(pattern)
    out.put(time.perf_counter() - t0)


def _plan_part(idx: Any, k: int) -> int:
    """Reader ``k``'s part of epoch 0 (of 1,024 x 16 readers), its slices' offsets decoded."""
    from mixer.plan.shards import plan
    from mixer.plan.world import World

    ranks, workers = WORLD
    reader = (k * 7919) % (ranks * workers)
    world = World(rank=reader // workers, world_size=ranks, worker=reader % workers, num_workers=workers)
    slices = plan(len(idx.shards), world, seed=0, source="x", epoch=0, index=idx)
    for sl in slices:
        idx.offsets(sl.shard)
    return len(slices)


def _worker(idx: Any, k: int, out: Any) -> None:
    """A DataLoader worker of a rank that loaded ``idx``: what a garbage collection and planning its
    part make private (``idx`` None: the reference worker, which only collects)."""
    import gc

    before = _uss_mb()
    gc.collect()  # (a worker's collections visit every object it inherited: a per-shard object costs a page copy)
    if idx is not None:
        _plan_part(idx, k)
    out.put(_uss_mb() - before)


def _forked(idx: Any, k: int) -> float:
    """The USS a worker forked now adds for the index: a planning worker's growth less a reference
    worker's (the page copies any forked worker makes, whatever it reads)."""
    ctx = multiprocessing.get_context("fork")
    growth = []
    for arg in (idx, None):
        got = ctx.Queue()
        p = ctx.Process(target=_worker, args=(arg, k, got))
        p.start()
        growth.append(got.get(timeout=600))
        p.join()
    return max(growth[0] - growth[1], 0.0)


def _rank(pattern: str, k: int, barrier: Any, out: Any) -> None:
    """Rank ``k`` of a node: load the index (its twin present), then fork ``WORKERS`` workers that
    plan; measured while every rank holds the index (the mapped pages are shared)."""
    import mixer
    from mixer.plan import index as index_module

    before = _uss_mb()
    source = mixer.Source("x", pattern)
    t0 = time.perf_counter()
    cols = index_module._read(str(Path(pattern).parent / "mixer-index.json.gz"), source, index_module.tokens_by(source))
    read_s = time.perf_counter() - t0
    read_uss = _uss_mb() - before
    t0 = time.perf_counter()
    idx = mixer.load_index(source)
    load_s = time.perf_counter() - t0
    idx.tokens.sum(), idx.length_sample()  # what a mixture's main process reads of it (its profile)
    rank_uss = _uss_mb() - before
    barrier.wait()
    workers = [_forked(idx, k * WORKERS + w) for w in range(WORKERS)]
    out.put(
        {
            "read_s": read_s,
            "read_uss_mb": read_uss,
            "load_s": load_s,
            "rank_uss_mb": rank_uss,
            "worker_uss_mb": float(np.median(workers)),
        }
    )
    del cols
    barrier.wait()


def _json_worker(entries: Any, out: Any) -> None:
    """The baseline worker: what the JSON load's objects cost a forked worker that collects and plans
    (the per-shard arrays read from the entries, as the index's ``counts`` and ``weights`` were)."""
    import gc

    before = _uss_mb()
    gc.collect()
    if entries is not None:
        np.fromiter((e.samples for e in entries), dtype=np.int64, count=len(entries))
        np.fromiter((e.weight for e in entries), dtype=np.int64, count=len(entries))
        entries[0].offsets()
    out.put(_uss_mb() - before)


def _json_load(folder: str, out: Any) -> None:
    """The baseline: the index file parsed into an object per entry, as a load did before the twin."""
    from mixer.plan.shard_index import DEFAULT_NAME, decode_file

    before = _uss_mb()
    t0 = time.perf_counter()
    data = Path(folder, DEFAULT_NAME).read_bytes()
    _, parsed = decode_file(data, folder)
    seconds = time.perf_counter() - t0
    del data
    entries = tuple(parsed.values())
    rank_uss = _uss_mb() - before
    ctx = multiprocessing.get_context("fork")
    growth = []
    for arg in (entries, None):
        got = ctx.Queue()
        p = ctx.Process(target=_json_worker, args=(arg, got))
        p.start()
        growth.append(got.get(timeout=600))
        p.join()
    worker = max(growth[0] - growth[1], 0.0)
    out.put({"json_load_s": seconds, "json_rank_uss_mb": rank_uss, "json_worker_uss_mb": worker})


def _spawned(target: Any, args: tuple[Any, ...], n: int = 1) -> list[Any]:
    """``target(*args, [k, barrier,] queue)`` in ``n`` fresh processes at once; what each put."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(n)
    procs = [
        ctx.Process(target=target, args=(*args, k, barrier, out) if target is _rank else (*args, out)) for k in range(n)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{target.__name__} exited with {p.exitcode}")
    return results


def measure(root: Path, samples: int, json_up_to: int, readers: int) -> dict[str, Any]:
    folder, pattern = ensure_index(root, samples)
    twin = _twin(folder)
    first = _spawned(_first_load, (pattern, str(twin)))[0]
    ranks = _spawned(_rank, (pattern,), n=readers)
    row: dict[str, Any] = {
        "samples": samples,
        "shards": samples // PER_SHARD,
        "disk_json_mb": (folder / "mixer-index.json.gz").stat().st_size / 1e6,
        "disk_columns_mb": twin.stat().st_size / 1e6,
        "first_load_s": first,
        "read_s": float(np.median([r["read_s"] for r in ranks])),
        "read_uss_mb": float(max(r["read_uss_mb"] for r in ranks)),
        "load_s": float(np.median([r["load_s"] for r in ranks])),
        "rank_uss_mb": float(max(r["rank_uss_mb"] for r in ranks)),
        "uss_mb": float(np.median([r["worker_uss_mb"] for r in ranks])),
        "uss_max_mb": float(max(r["worker_uss_mb"] for r in ranks)),
        "json_load_s": None,
        "json_rank_uss_mb": None,
        "json_worker_uss_mb": None,
        "extrapolated": False,
    }
    if samples <= json_up_to:
        row.update(_spawned(_json_load, (str(folder),))[0])
    return row


def extrapolate(a: dict[str, Any], b: dict[str, Any], samples: int) -> dict[str, Any]:
    """A row at ``samples`` on the line through rows ``a`` and ``b`` (each figure linear in samples,
    never below ``b``'s: a flat figure's noise does not extrapolate to a negative one)."""
    out: dict[str, Any] = {"samples": samples, "shards": samples // PER_SHARD, "extrapolated": True}
    for key, va in a.items():
        vb = b.get(key)
        if key in out or not isinstance(va, (int, float)) or isinstance(va, bool) or vb is None:
            continue
        slope = (vb - va) / (b["samples"] - a["samples"])
        out[key] = max(vb + slope * (samples - b["samples"]), vb)  # (a cost does not shrink as data grows)
    return out


def run(profile: str, bench_dir: Path | None = None, log: Any = None) -> list[dict[str, Any]]:
    """Rows for every size of ``profile`` (see the module docstring), then the extrapolation to 1e9 samples."""
    root = Path(bench_dir) / NAME if bench_dir is not None else DEFAULT_DIR
    rows = []
    for samples in SIZES[profile]:
        row = measure(root, samples, JSON_UP_TO[profile], READERS[profile])
        if log is not None:
            log(f"{row}")
        rows.append(row)
    rows.append(extrapolate(rows[-2], rows[-1], 10**9))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    head = (
        "| samples | shards | JSON file | its twin | first load | index load (its USS) | load_index (rank USS) "
        "| USS per reader (worker) | before: JSON load (rank USS, worker USS) |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        mark = " (extrapolated)" if r["extrapolated"] else ""
        lines.append(
            f"| {r['samples']:.0e}{mark} | {r['shards']:,} | {f(r.get('disk_json_mb'), '.1f')} MB | "
            f"{f(r.get('disk_columns_mb'), '.1f')} MB | {f(r.get('first_load_s'), '.2f')} s | "
            f"{f(r.get('read_s'), '.4f')} s ({f(r.get('read_uss_mb'), '.1f')} MB) | "
            f"{f(r.get('load_s'), '.2f')} s ({f(r.get('rank_uss_mb'), '.1f')} MB) | {f(r.get('uss_mb'), '.1f')} MB "
            f"(max {f(r.get('uss_max_mb'), '.1f')}) | "
            f"{f(r.get('json_load_s'), '.2f')} s ({f(r.get('json_rank_uss_mb'), '.0f')} MB, "
            f"{f(r.get('json_worker_uss_mb'), '.0f')} MB) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.world_scale_index", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--bench-dir", type=Path, default=None)
    opts = p.parse_args(argv)
    rows = run("quick" if opts.quick else "full", opts.bench_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(rows))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
