"""One rank of a `torchrun` job for tests/runtime/test_sync_faults.py (gloo on CPU, 127.0.0.1 only).

    python -m torch.distributed.run --nnodes=2 --node-rank=K ... tests/support/dist_fault_worker.py SPEC.json OUT_DIR

Every rank iterates a finite loader (``make_loader(sync_timeout=...)``); the rank ``victim`` stops
itself (SIGSTOP, ``how="stop"``) or is killed (SIGKILL, ``how="kill"``) after handing out ``at``
batches, as a frozen or crashed trainer would, or is only late (sleeps ``late_s``, ``how="late"``).
Every other rank records what its loop ended with in ``OUT_DIR/rank<r>.json`` (the error's type and
message, the batches it got, the seconds from its last batch to the error) and then returns normally:
a process left with a pending collective would hang here at exit, which the test sees. The stopped
victim writes its pid to ``OUT_DIR/victim.pid`` first, so the test can end it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mixer


def main() -> int:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sources = [mixer.Source(s["name"], s["pattern"], weight=s["weight"]) for s in spec["sources"]]
    mix = mixer.Mixture(
        sources, batching=mixer.TokenBudget(max_tokens=spec["max_tokens"]), stop="all_exhausted", seed=0
    )
    loader = mixer.make_loader(mix, num_workers=spec["num_workers"], sync_timeout=spec["timeout"])
    result: dict = {"rank": rank, "pid": os.getpid(), "batches": 0}
    last = time.monotonic()
    try:
        for _ in loader:
            result["batches"] += 1
            if rank == spec["victim"] and result["batches"] == spec["at"]:
                if spec["how"] == "stop":
                    (out / "victim.pid").write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif spec["how"] == "late":
                    time.sleep(spec["late_s"])
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            result["longest_wait_s"] = max(result.get("longest_wait_s", 0.0), time.monotonic() - last)
            last = time.monotonic()
        result["error"] = None
        sync = loader.sync
        assert sync is not None
        time.sleep(0.5)  # a note is removed by a thread of its own
        store = dist.group.WORLD.get_group_store()
        result["notes_left"] = [seq for seq in range(1, sync._collectives + 1) if store.check([sync._key(seq, rank)])]
    except Exception as exc:  # recorded for the test to judge
        result["error"] = {"type": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - last}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
