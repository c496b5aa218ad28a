"""One trainer of a `torchrun` job for tests/test_service.py (gloo on CPU, 127.0.0.1, inside the
session's loopback-only namespace): it consumes its part of a running mixer service.

    python -m torch.distributed.run --nproc_per_node=2 tests/service_worker.py SPEC.json OUT_DIR run|resume

SPEC.json: ``{"service": name, "address": the Ray cluster's GCS address, "cuts": [batches per rank]}``.
``run``: each rank hands out ``cuts[rank]`` batches (no stop sync: the ranks stop apart), saves its
loader state to ``OUT_DIR/state-rank<r>.pt`` and exits. ``resume``: new processes load those states
and run to the end of the pass with the stop sync on (fillers). Both write the views of the batches
handed out to ``OUT_DIR/<phase>-rank<r>.json``.
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
    spec, out, phase = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ray.init(address=spec["address"], log_to_driver=False)
    views = []
    if phase == "run":
        loader = make_remote_loader(spec["service"], sync_stop=False)  # rank from the process group
        for batch in loader:
            views.append(view(batch))
            if len(views) == spec["cuts"][rank]:
                break
        torch.save({"data": loader.state_dict()}, out / f"state-rank{rank}.pt")
    else:
        loader = make_remote_loader(spec["service"])
        loader.load_state_dict(torch.load(out / f"state-rank{rank}.pt", weights_only=True)["data"])
        views = [view(batch) for batch in loader]
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps(views))
    dist.destroy_process_group()
    ray.shutdown()


if __name__ == "__main__":
    main()
