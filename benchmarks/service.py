"""Mixing as a service: trainer-side CPU per sample and stall per step, in-process vs on a service.

    python -m benchmarks service [--quick] [--rounds N] [--step-ms MS]

The source is decode-heavy: the FLAC speech corpora of `layouts` (synthetic tones with a noise floor,
`SpeechDecode` + `Mixture(fields=...)`, 60 s of audio per batch), one pass (`stop="all_exhausted"`).
Each method runs the same training loop: take a batch, then a simulated step of ``--step-ms`` (a
sleep, so that the step takes no CPU from the readers on this small machine):

* ``inproc_w0`` — ``make_loader(num_workers=0)``: the trainer decodes everything itself;
* ``inproc_w2`` — ``make_loader(num_workers=2)``: two DataLoader workers on the trainer's machine;
* ``service_r2`` — a ``MixerService`` with 2 readers per trainer, on a local Ray cluster, and
  ``make_remote_loader`` (groups of up to 32 batches, 2 calls in flight per reader).

Measured per pass: *trainer CPU* (this process only: for ``inproc_w2`` the main process, which
receives the workers' batches; for the service the trainer, which receives groups from Ray and keeps
the books), *trainer-node CPU* (what runs on the trainer's machine: the main process and its
DataLoader workers; for the service the trainer alone, the readers being elsewhere), *total CPU*
(every process: for the service the trainer, the reader actors and Ray's own processes, the raylet
holding the object store), wall time, and the *stall*: the time the loop waits for its next batch,
per step. Target: the service's trainer CPU per sample within 1.3x of the in-process loader's main
process with the same number of readers (the transport's price on the trainer).

Ray runs in a network namespace that has only loopback (this benchmark re-executes itself under
``unshare -n``, which needs root, and refuses to start Ray if it sees another interface). On one
machine the readers compete with the trainer for the same cores; on a multi-node cluster the readers
run on other nodes, so the trainer node's CPU is the trainer's alone and the stall falls as readers
are added, while the transport adds the network: a group crosses from the reader's node to the
trainer's object store (the readers' CPU then shows on their nodes, not here).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import common
from .layouts import ensure_speech, speech_mixture

NAME = "service"
METHODS = {
    "inproc_w0": "in-process, num_workers=0",
    "inproc_w2": "in-process, num_workers=2",
    "service_r2": "service, 2 readers per trainer",
}
DEFAULT_STEP_MS = 10.0


# ---- inside the namespace: the measurements ------------------------------------------------------


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _descendants_cpu() -> float:
    """CPU of the processes below this one that are alive (Ray's: raylet, GCS, workers, actors)."""
    import psutil

    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _train(loader: Any, step_s: float) -> dict[str, Any]:
    """The loop every method runs: a batch, then the simulated step. Returns counts and the stall."""
    samples = batches = 0
    stall = 0.0
    it = iter(loader)
    while True:
        t = time.perf_counter()
        batch = next(it, None)
        stall += time.perf_counter() - t
        if batch is None:
            break
        samples += len(batch)
        batches += 1
        time.sleep(step_s)
    return {"samples": samples, "batches": batches, "stall_s": stall}


def _measure(run: Callable[[], dict[str, Any]], *, ray_side: bool) -> dict[str, Any]:
    common.reap_children()
    s0, c0 = _self_cpu(), _children_cpu()
    d0 = _descendants_cpu() if ray_side else 0.0
    t0 = time.perf_counter()
    out = run()
    wall = time.perf_counter() - t0
    common.reap_children()
    s1, c1 = _self_cpu(), _children_cpu()
    d1 = _descendants_cpu() if ray_side else 0.0
    trainer = s1 - s0
    node = trainer + (c1 - c0)  # the trainer's machine: it and its DataLoader workers (reaped)
    total = node + (d1 - d0)
    return {**out, "wall_s": wall, "trainer_cpu_s": trainer, "node_cpu_s": node, "total_cpu_s": total}


def inner(config: dict[str, Any]) -> dict[str, Any]:
    names = sorted(n for _, n in socket.if_nameindex())
    if names != ["lo"]:
        raise SystemExit(f"network interfaces {names}: not a loopback-only namespace; Ray not started")
    import ray
    import torch

    import mixer
    from mixer.service import MixerService, make_remote_loader

    torch.set_num_threads(1)
    corpora = {k: tuple(v) for k, v in config["corpora"].items()}
    mixture = speech_mixture(corpora)  # built once: it profiles the corpora
    utterances = sum(u for _, u, _ in corpora.values())
    step_s = config["step_ms"] / 1e3
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=config["temp"], object_store_memory=1 << 30
    )
    service = MixerService(mixture, readers_per_trainer=2, name="bench", reader_options={"num_cpus": 0.5})
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "inproc_w0": lambda: _train(mixer.make_loader(mixture, num_workers=0), step_s),
        "inproc_w2": lambda: _train(mixer.make_loader(mixture, num_workers=2), step_s),
        "service_r2": lambda: _train(make_remote_loader(service, rank=0), step_s),
    }
    names_in_order = [m for m in config["methods"] if m in runs]
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in names_in_order}
    for r in range(config["rounds"]):
        k = r % len(names_in_order)
        for m in names_in_order[k:] + names_in_order[:k]:
            got = _measure(runs[m], ray_side=m.startswith("service"))
            if got["samples"] != utterances:
                raise RuntimeError(f"{m}: one pass delivered {got['samples']} utterances of {utterances}")
            rounds[m].append(got)
            print(
                f"round {r + 1} {m:12s} {got['wall_s']:6.2f} s wall, trainer {got['trainer_cpu_s']:6.2f} s, "
                f"total {got['total_cpu_s']:6.2f} s CPU, stall {1e3 * got['stall_s'] / got['batches']:.1f} ms/step",
                file=sys.stderr,
                flush=True,
            )
    service.close()
    ray.shutdown()
    return {"rounds": rounds, "utterances": utterances}


# ---- outside: the namespace, the table ---------------------------------------------------------------


def _in_namespace(config: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise RuntimeError("needs unshare and ip to run Ray in a loopback-only network namespace")
    with tempfile.TemporaryDirectory(prefix="mxbench-", dir="/tmp") as tmp:
        cfg, out = Path(tmp) / "config.json", Path(tmp) / "out.json"
        cfg.write_text(json.dumps({**config, "temp": str(Path(tmp) / "ray")}))
        cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
        cmd += [sys.executable, "-m", "benchmarks.service", "--inner", str(cfg), str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
        env["PYTHONPATH"] = os.pathsep.join([str(common.REPO), env.get("PYTHONPATH", "")])
        log("running the methods in a loopback-only network namespace (unshare -n) ...")
        proc = subprocess.run(cmd, cwd=common.REPO, env=env, stderr=subprocess.PIPE, text=True, timeout=3600)
        for line in proc.stderr.splitlines():
            if line.startswith("round "):
                log(line)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"the measurement failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _per_sample(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [1e6 * r[key] / r["samples"] for r in runs]


def _row(name: str, runs: list[dict[str, Any]] | None, error: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"bench": NAME, "method": name, "label": METHODS[name], "kind": "batched"}
    if not runs:
        row.update(status="error" if error and "namespace" not in error else "skipped", note=error or "not run")
        return row
    med = common._median
    row.update(
        status="ok",
        rounds=len(runs),
        samples=runs[-1]["samples"],
        samples_per_s=med([r["samples"] / r["wall_s"] for r in runs]),
        cpu_us_per_sample=med(_per_sample(runs, "total_cpu_s")),
        trainer_cpu_us_per_sample=med(_per_sample(runs, "trainer_cpu_s")),
        node_cpu_us_per_sample=med(_per_sample(runs, "node_cpu_s")),
        stall_ms_per_step=med([1e3 * r["stall_s"] / r["batches"] for r in runs]),
        wall_s=med([r["wall_s"] for r in runs]),
        per_round=runs,
    )
    row["note"] = (
        f"trainer {row['trainer_cpu_us_per_sample']:.0f} / trainer node {row['node_cpu_us_per_sample']:.0f} / "
        f"total {row['cpu_us_per_sample']:.0f} CPU-µs per utterance; stall {row['stall_ms_per_step']:.1f} ms per step"
    )
    return row


def _ratios(a: list[dict[str, Any]], b: list[dict[str, Any]], key_a: str, key_b: str) -> list[float]:
    return [x / y for x, y in zip(_per_sample(a, key_a), _per_sample(b, key_b)) if y > 0]


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> common.BenchResult:
    corpora = ensure_speech(opts.profile, opts.bench_dir, log)
    step_ms = getattr(opts, "step_ms", DEFAULT_STEP_MS)
    config = {"corpora": corpora, "rounds": opts.rounds, "step_ms": step_ms, "methods": list(METHODS)}
    error = common.missing("mixer.service", "MixerService", "make_remote_loader")
    got: dict[str, Any] = {}
    if error is None:
        try:
            got = _in_namespace(config, log)
        except Exception as exc:  # the table says why (a machine without unshare/root, a failed run)
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            log(f"FAILED: {exc}")
    rounds = got.get("rounds", {})
    rows = [_row(m, rounds.get(m), error) for m in METHODS]
    w0, w2, svc = (rounds.get(m, []) for m in METHODS)
    checks = [
        common.values_check(
            NAME,
            "trainer CPU-µs/utterance, service (2 readers) / in-process main process (2 workers)",
            _ratios(svc, w2, "trainer_cpu_s", "trainer_cpu_s"),
            1.3,
            "<=",
        ),
        common.values_check(
            NAME,
            "total CPU-µs/utterance (every process), service / in-process with 2 workers",
            _ratios(svc, w2, "total_cpu_s", "total_cpu_s"),
            None,
            "<=",
        ),
        common.values_check(
            NAME,
            "trainer-node CPU-µs/utterance, service / in-process with 2 workers (the node's saving)",
            _ratios(svc, w2, "node_cpu_s", "node_cpu_s"),
            None,
            "<=",
        ),
        common.values_check(
            NAME,
            "trainer-node CPU-µs/utterance, service / in-process with 0 workers",
            _ratios(svc, w0, "node_cpu_s", "node_cpu_s"),
            None,
            "<=",
        ),
        *[
            common.values_check(
                NAME, f"stall ms per step, {m}", [1e3 * r["stall_s"] / r["batches"] for r in rounds.get(m, [])], None
            )
            for m in METHODS
        ],
    ]
    config.update(
        profile=opts.profile,
        utterances=got.get("utterances"),
        shards=f"speech ({opts.profile}): " + ", ".join(f"{n} {u} utterances" for n, (_, u, _) in corpora.items()),
        table=_table(rows),
    )
    return common.BenchResult(NAME, rows, checks, config)


def _table(rows: list[dict[str, Any]]) -> str:
    body = [
        [
            r["label"],
            common._fmt(r.get("trainer_cpu_us_per_sample"), ".0f"),
            common._fmt(r.get("node_cpu_us_per_sample"), ".0f"),
            common._fmt(r.get("cpu_us_per_sample"), ".0f"),
            common._fmt(r.get("stall_ms_per_step"), ".1f"),
            common._fmt(r.get("wall_s"), ".2f"),
            r.get("note", "") if r.get("status") != "ok" else "",
        ]
        for r in rows
    ]
    header = [
        "method",
        "trainer CPU-µs/utt",
        "trainer-node CPU-µs/utt",
        "total CPU-µs/utt",
        "stall ms/step",
        "wall s",
        "",
    ]
    return common.markdown_table(header, body)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.service", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the small speech set, 1 round")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; 1 with --quick)")
    p.add_argument("--step-ms", type=float, default=DEFAULT_STEP_MS, help="the simulated training step (a sleep)")
    p.add_argument("--bench-dir", type=Path, default=common.DEFAULT_BENCH_DIR)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inner"]:
        config = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(inner(config)))
        return 0
    p = parser()
    opts = p.parse_args(argv)
    if opts.rounds is None:
        opts.rounds = 1 if opts.quick else 3
    return common.standalone(NAME, _Parsed(opts), run, [])


class _Parsed:
    """``common.standalone`` parses its arguments itself: hand it the ones parsed here."""

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts

    def parse_args(self, argv: list[str] | None) -> argparse.Namespace:
        return self.opts


if __name__ == "__main__":
    sys.exit(main())
