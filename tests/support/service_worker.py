"""One trainer of a `torchrun` job for tests/test_service.py (gloo on CPU, 127.0.0.1, inside the
session's loopback-only namespace): it consumes its part of a running mixer service, and restarts.

    python -m torch.distributed.run --nproc_per_node=2 tests/support/service_worker.py SPEC.json OUT_DIR

SPEC.json: ``{"service": name, "address": the Ray cluster's GCS address, "cuts": [batches per rank]}``.
``run``: each rank hands out ``cuts[rank]`` batches (no stop sync: the ranks stop apart), saves its
loader state to ``OUT_DIR/state-rank<r>.pt`` and leaves Ray (``ray.shutdown()``: its Ray job ends,
with whatever it had asked the readers for). ``resume``: the trainer joins the cluster again as a new
Ray job, finds the service by name, loads its state from the file and runs to the end of the pass
with the stop sync on (fillers). A new process would do the same; this one keeps the cost of
importing torch and Ray out of the test. Both phases write the views of the batches handed out to
``OUT_DIR/<phase>-rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from test_service import view

from mixer.service import make_remote_loader


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = out / f"state-rank{rank}.pt"

    ray.init(address=spec["address"], log_to_driver=False)
    loader = make_remote_loader(spec["service"], sync_stop=False)  # rank from the process group
    views = []
    for batch in loader:
        views.append(view(batch))
        if len(views) == spec["cuts"][rank]:
            break
    torch.save({"data": loader.state_dict()}, state)
    (out / f"run-rank{rank}.json").write_text(json.dumps(views))
    del loader
    ray.shutdown()

    ray.init(address=spec["address"], log_to_driver=False)
    loader = make_remote_loader(spec["service"])
    loader.load_state_dict(torch.load(state, weights_only=True)["data"])
    views = [view(batch) for batch in loader]
    (out / f"resume-rank{rank}.json").write_text(json.dumps(views))
    ray.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
