"""benchmarks/multigpu.py runs under `torch.distributed.run` with 2 CPU processes (gloo) and reports
per rank and in total; the figures themselves are not judged here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_cpu_ranks_under_gloo(three_sources, tmp_path):
    config = tmp_path / "mix.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "sources": [
                    {"name": name, "urls": three_sources[name][0], "weight": w}
                    for name, w in (("web", 0.6), ("code", 0.3), ("books", 0.1))
                ],
                "batching": {"max_tokens": 16384},
                "seed": 1,
            }
        )
    )
    out = tmp_path / "multigpu.json"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "benchmarks/multigpu.py",
            "--config",
            str(config),
            "--device",
            "cpu",
            "--steps",
            "8",
            "--warmup",
            "2",
            "--step-ms",
            "5",
            "--workers",
            "0",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| device | ranks | workers/rank | step ms (measured) | rank | real tok/s |" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| cpu | 2 | 0 | 5 (")]
    assert [row.split(" | ")[4] for row in rows] == ["0", "1", "total"]
    result = json.loads(out.read_text())
    assert result["config"]["world_size"] == 2
    ranks = [r["rank"] for r in result["rows"]]
    assert ranks == [0, 1, "total"]
    r0, r1, total = result["rows"]
    for r in (r0, r1):
        assert r["steps"] == 8 and r["tokens"] > 0 and r["tokens_per_s"] > 0
        assert 0 <= r["stall_pct"] <= 100 and r["stalled_steps"] <= 8
        assert r["data_ms_max"] >= r["data_ms_p50"] >= 0
        assert r["step_ms_measured"] >= 5.0  # each step sleeps 5 ms
        assert math.isnan(r["h2d_GBps"])  # no copies on the CPU path
    assert total["tokens"] == r0["tokens"] + r1["tokens"]
    assert total["stalled_steps"] == r0["stalled_steps"] + r1["stalled_steps"]
    assert result["checks"] and result["checks"][0]["result"] == "info"  # no GPU target judged on CPU
    # the saved result prints again through --summarize (as gpu_check.sh does with its runs)
    again = subprocess.run(
        [sys.executable, "benchmarks/multigpu.py", "--summarize", str(out), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert sum(line.startswith("| cpu | 2 | 0 | 5 (") for line in again.stdout.splitlines()) == 6
