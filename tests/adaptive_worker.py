"""One rank of a `torchrun` job for tests/test_adaptive_dist.py (gloo on CPU, 127.0.0.1 only).

    python -m torch.distributed.run --nproc_per_node=N tests/adaptive_worker.py PATTERNS.json OUT_DIR

Every rank builds the same adaptive mixture (rank and world size from the process group), takes
STEPS batches with 2 workers, reports a loss per sample that depends on the rank (so the ranks'
windows differ and only the all-reduce makes them agree) and writes ``OUT_DIR/rank<r>.json``: per
step the target the batch carried, and the adaptive part of ``stats()`` at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

import mixer

STEPS = 30


def main() -> None:
    patterns, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sources = [mixer.Source(name, pattern, weight=w) for name, (pattern, w) in patterns.items()]
    schedule = mixer.Adaptive(mixer.Weights({n: w for n, (_, w) in patterns.items()}), policy="exp_gradient", lr=4.0,
                              update_every=4, smoothing=0.1)  # fmt: skip
    mix = mixer.Mixture(sources, batching=mixer.TokenBudget(max_tokens=2048), schedule=schedule, shuffle_buffer=32, state_every=4)
    loader = mixer.make_loader(mix, num_workers=2)
    steps = []
    for batch in loader:
        loss = (batch.source.double() + 1) * (rank + 1) + batch.lengths.double() / 1000
        loader.feedback(batch, loss)
        steps.append({"step": batch.meta.step, "target": batch.meta.target, "sources": batch.source.tolist()})
        if len(steps) == STEPS:
            break
    (out / f"rank{rank}.json").write_text(json.dumps({"steps": steps, "adaptive": loader.stats()["adaptive"]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
