"""One rank of a `torchrun` job for tests/test_elastic_settle.py (gloo on CPU, 127.0.0.1).

    python -m torch.distributed.run --nproc_per_node=N tests/support/elastic_agree_worker.py SPEC.json OUT_DIR agree

The states were saved by tests/support/elastic_worker.py (``OUT_DIR/state-rank<r>.pt``). Each rank loads them
lazily (a sequence that reads file ``r`` when asked for ``states[r]``) with ``Loader.load_state_dict``,
which agrees with the other ranks in one all_reduce, and also computes its state reading every file
(``mixer.mixing.elastic.resume_state`` without an agreement). It writes both and the files it read to
``OUT_DIR/agree-rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mixer
from mixer.mixing import elastic


class Files(Sequence[dict[str, Any]]):
    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, r: Any) -> Any:
        self.read.append(r)
        return torch.load(self.paths[r], weights_only=True)["data"]


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
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
    workers = spec["workers"][1]
    paths = sorted(out.glob("state-rank*.pt"))
    files = Files(paths)
    loader = mixer.make_loader(mix, num_workers=workers)
    loader.load_state_dict(files)
    agreed = loader.state_dict()
    alone = elastic.resume_state(mix, [torch.load(p, weights_only=True)["data"] for p in paths], num_workers=workers)
    text = {"agreed": agreed, "alone": alone, "read": sorted(set(files.read))}
    (out / f"agree-rank{rank}.json").write_text(json.dumps(text, sort_keys=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
