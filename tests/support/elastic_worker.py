"""One rank of a `torchrun` job for the elastic test in tests/mixing/test_elastic.py (gloo on CPU, 127.0.0.1).

    python -m torch.distributed.run --nproc_per_node=N tests/support/elastic_worker.py SPEC.json OUT_DIR save|resume

``save``: every rank hands out ``cuts[rank]`` batches (no stop sync: the ranks stop apart) and saves
its own state, ``OUT_DIR/state-rank<r>.pt`` (a file per rank, as torch.distributed.checkpoint does).
``resume``: every rank of the new job reads all those files and loads the list (elastic resume), then
iterates to the end with the stop sync on (fillers). Both write the keys each rank handed out to
``OUT_DIR/<phase>-rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import mixer


def main() -> None:
    spec, out, phase = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sources = [mixer.Source(name, pattern, weight=weight) for name, pattern, weight in spec["sources"]]
    mix = mixer.Mixture(
        sources,
        batching=mixer.TokenBudget(max_tokens=1024),
        stop="all_exhausted",
        seed=7,
        shuffle_buffer=16,
        state_every=3,
    )
    keys: list[str] = []
    if phase == "save":
        loader = mixer.make_loader(mix, num_workers=spec["workers"][0], sync_stop=False)
        for n, batch in enumerate(loader, start=1):  # stop right after the cut: the loader counts what it hands out
            keys += batch.keys
            if n == spec["cuts"][rank]:
                break
        torch.save({"data": loader.state_dict()}, out / f"state-rank{rank:05d}.pt")
    else:
        loader = mixer.make_loader(mix, num_workers=spec["workers"][1])
        paths = sorted(out.glob("state-rank*.pt"))
        loader.load_state_dict([torch.load(p, weights_only=True)["data"] for p in paths])
        for batch in loader:
            if not batch.filler:
                keys += batch.keys
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps(keys))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
