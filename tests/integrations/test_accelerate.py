"""Accelerate (real, on CPU) with mixer: examples/accelerate_train.py registers the loader for
checkpointing, and a run resumed from ``accelerator.save_state`` trains, step for step, the batches
of the uninterrupted run; with 2 processes through ``mixer.integrations.AllRanks``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import free_port
from shardutil import LogNormal

pytest.importorskip("accelerate", reason="accelerate is not installed")

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "accelerate_train.py"
SOURCES = {
    "web": LogNormal(shards=8, samples=1200, median=120, sigma=0.7, lo=8, hi=1024, seed=0),
    "code": LogNormal(shards=4, samples=600, median=300, sigma=0.5, lo=16, hi=1024, seed=1),
}
STEPS, EVERY = 12, 5


@pytest.fixture(scope="module")
def source_args(make_sources):
    patterns = {name: pattern for name, (pattern, _) in make_sources(SOURCES).items()}
    return [arg for name, pattern in patterns.items() for arg in ("--source", f"{name}={pattern}")]


def _keys(folder: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (folder / f"keys-rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_save_state_and_load_state_resume_the_stream_exactly(source_args, tmp_path, workers):
    spec = importlib.util.spec_from_file_location("accelerate_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = [*source_args, "--workers", str(workers), "--steps", str(STEPS)]
    example.main(
        [*common, "--ckpt-every", str(EVERY), "--ckpt-dir", str(tmp_path / "ck"), "--keys-out", str(tmp_path / "full")]
    )
    resume = tmp_path / "ck" / f"step-{EVERY:06d}"
    example.main([*common, "--resume", str(resume), "--keys-out", str(tmp_path / "resumed")])
    full = _keys(tmp_path / "full")
    assert [r["step"] for r in full] == list(range(1, STEPS + 1))
    assert _keys(tmp_path / "resumed") == full[EVERY:]


@pytest.mark.slow
def test_two_processes_resume_every_rank_through_all_ranks(source_args, tmp_path):
    """Accelerate writes registered objects from the main process only; AllRanks gathers both
    ranks' loader states into that file, and each rank resumes from its own (2 DataLoader workers)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            [str(HERE.parents[1]), str(HERE.parent / "support"), os.environ.get("PYTHONPATH", "")]
        ),
    )

    def launch(*args: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(EXAMPLE),
            *source_args,
            "--workers",
            "2",
            "--steps",
            str(STEPS),
            *args,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    launch("--ckpt-every", str(EVERY), "--ckpt-dir", str(tmp_path / "ck"), "--keys-out", str(tmp_path / "full"))
    launch("--resume", str(tmp_path / "ck" / f"step-{EVERY:06d}"), "--keys-out", str(tmp_path / "resumed"))
    for rank in (0, 1):
        full = _keys(tmp_path / "full", rank)
        assert [r["step"] for r in full] == list(range(1, STEPS + 1))
        assert _keys(tmp_path / "resumed", rank) == full[EVERY:], f"rank {rank}: the resumed run differs"
    assert not set(_keys(tmp_path / "full", 0)[0]["keys"]) & set(_keys(tmp_path / "full", 1)[0]["keys"])
