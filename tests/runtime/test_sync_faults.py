"""A rank that freezes or dies under `torchrun` (gloo on CPU, 127.0.0.1): the other ranks raise
`MixerError` within `make_loader(sync_timeout=...)`, naming the collective and the silent rank,
instead of waiting for the process group's 30-minute timeout or failing with gloo's bare
`RuntimeError`; and their processes then exit by themselves (no collective left pending).

The victim runs under its own torchrun agent, as on another node: an agent ends all of its workers
when one of them dies, which would hide what the survivors do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from servers import free_port
from shardutil import LogNormal
from waiting import wait_for_files

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "dist_fault_worker.py"
MAX_TOKENS = 512


@pytest.fixture(scope="module")
def sources(make_sources: Any) -> list[dict[str, Any]]:
    # enough batches that no rank's stream ends before the victim acts
    written = make_sources(
        {"web": LogNormal(shards=8, samples=1600, median=60, sigma=0.5, seed=5, lo=4, hi=MAX_TOKENS)}
    )
    return [{"name": "web", "pattern": written["web"][0], "weight": 1.0}]


def _exited(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def launch(
    tmp_path: Path, sources: list[dict[str, Any]], *, survivors: int, how: str, timeout: float, num_workers: int
) -> list[dict[str, Any]]:
    """Runs ``survivors`` ranks under one agent and the victim (the last rank) under another; returns
    the survivors' results (and a late victim's) once each of those processes has exited by itself."""
    out = tmp_path / "out"
    out.mkdir()
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "sources": sources,
                "max_tokens": MAX_TOKENS,
                "num_workers": num_workers,
                "timeout": timeout,
                "victim": survivors,
                "at": 3,
                "how": how,
                "late_s": 2.5,
            }
        )
    )
    port = free_port()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )

    def agent(node: int, nproc: int) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--max-restarts=0",
            str(WORKER),
            str(spec),
            str(out),
        ]
        return subprocess.Popen(
            cmd, stdout=(tmp_path / f"agent{node}.log").open("wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO
        )

    agents = [agent(0, survivors), agent(1, 1)]
    paths = [out / f"rank{r}.json" for r in range(survivors + (how == "late"))]
    try:
        # the survivors must give up on their own: bounded by the timeout plus start-up, and then
        # exit (an agent waits for the other agents at exit, so its own exit tells nothing)
        gave_up = wait_for_files(paths, timeout + 90)
        log = (tmp_path / "agent0.log").read_text(errors="replace")[-6000:]
        assert gave_up, f"the survivors did not give up in time:\n{log}"
        time.sleep(0.5)  # the results are written just before the return
        results = [json.loads(p.read_text()) for p in paths]
        deadline = time.monotonic() + 30
        while not all(_exited(r["pid"]) for r in results) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_exited(r["pid"]) for r in results), f"a survivor did not exit after its error:\n{log}"
    finally:
        pid = out / "victim.pid"
        if pid.exists() and not _exited(int(pid.read_text())):  # the stopped victim
            os.kill(int(pid.read_text()), signal.SIGKILL)
        for proc in agents:  # their workers have all ended by now; an agent itself would wait for the others
            proc.kill()
            proc.wait()
    return results


@pytest.mark.slow
def test_a_stopped_rank_makes_the_others_raise_within_the_timeout(tmp_path, sources):
    results = launch(tmp_path, sources, survivors=2, how="stop", timeout=5, num_workers=0)
    for res in results:
        err = res["error"]
        assert err is not None and err["type"] == "MixerError", res
        msg = err["message"]
        assert f"rank sync on rank {res['rank']}: the all_reduce that agrees on the next batch" in msg
        assert "got no answer within sync_timeout=5 s" in msg
        assert "rank(s) 2 of the 3 in the group never reached it" in msg
        # the victim stopped after its 3rd batch; the others got at most one more (the sync looks one ahead)
        assert 3 <= res["batches"] <= 4
        # given up after the timeout (counted from the start of the collective), plus the look
        # into the store (at most ~1.5 s), not the process group's 30 minutes
        assert 4 <= err["after_s"] <= 5 + 1 + 4, err


@pytest.mark.slow
def test_a_killed_rank_makes_the_others_raise_a_mixer_error_at_once(tmp_path, sources):
    # 2 DataLoader workers on every rank: forked after the process group was made, they inherit its
    # sockets; their parent-death watchdog ends them within 0.2 s, so the victim's connections close
    # (almost) as soon as it dies, and the survivor learns it long before its 60-second timeout.
    results = launch(tmp_path, sources, survivors=1, how="kill", timeout=60, num_workers=2)
    (res,) = results
    err = res["error"]
    assert err is not None and err["type"] == "MixerError", res  # not gloo's RuntimeError
    msg = err["message"]
    assert "rank sync on rank 0: the all_reduce that agrees on the next batch" in msg and "failed" in msg
    assert "a rank died or its connection broke" in msg and "rank(s) 1 of the 2 in the group never reached it" in msg
    assert err["after_s"] < 10, err


@pytest.mark.slow
def test_a_killed_rank_among_three_stops_every_survivor(tmp_path, sources):
    # with more survivors, one that is not waiting on the dead rank directly learns it from its own
    # timeout; either way each raises MixerError and exits
    results = launch(tmp_path, sources, survivors=2, how="kill", timeout=5, num_workers=0)
    for res in results:
        err = res["error"]
        assert err is not None and err["type"] == "MixerError", res
        assert "rank(s) 2 of the 3 in the group never reached it" in err["message"], err
        assert err["after_s"] <= 5 + 1 + 4, err


@pytest.mark.slow
def test_a_late_rank_within_the_timeout_is_waited_for(tmp_path, sources):
    # the victim sleeps 2.5 s once: the others wait past ARRIVED_AFTER_S (noting it in the store),
    # then carry on; the pass ends normally everywhere and no note is left behind
    results = launch(tmp_path, sources, survivors=2, how="late", timeout=10, num_workers=0)
    assert [r["error"] for r in results] == [None] * 3
    assert len({r["batches"] for r in results}) == 1 and results[0]["batches"] > 10  # equal step counts
    assert all(r["longest_wait_s"] >= 2 for r in results), [r["longest_wait_s"] for r in results]
    assert [r["notes_left"] for r in results] == [[]] * 3
