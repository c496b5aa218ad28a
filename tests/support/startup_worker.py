"""One rank of a `torchrun` job for tests/plan/test_startup.py (gloo on CPU, 127.0.0.1 only).

    python -m torch.distributed.run --nproc_per_node=N tests/support/startup_worker.py SPEC.json OUT_DIR

SPEC.json: ``{"sources": [{"name", "urls", "index"}], "cache": dir or null}``. Every rank builds the
Mixture (``TokenBudget(4096)``, the start-up shared as by default) and writes ``OUT_DIR/rank<r>.json``:
each source's shards (URLs and sizes), profile (lengths, size, origin), the bucket edges and the
fingerprint, or the error the construction raised (its type and message).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

import mixer


def build(spec: dict[str, Any]) -> dict[str, Any]:
    sources = [mixer.Source(s["name"], s["urls"], index=s.get("index")) for s in spec["sources"]]
    try:
        mix = mixer.Mixture(sources, batching=mixer.TokenBudget(4096), profile_cache=spec.get("cache"))
    except Exception as exc:  # noqa: BLE001 (recorded for the test to judge)
        return {"error": [type(exc).__name__, str(exc)]}
    return {
        "shards": [[list(ls.shards), [None if b is None else int(b) for b in ls.shard_bytes]] for ls in mix.listed],
        "profiles": [{"lengths": p.lengths.tolist(), "size": p.size, "origin": p.origin} for p in mix.profiles],
        "edges": mix.edges,
        "fingerprint": mix.fingerprint,
    }


def main() -> int:
    spec_path, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = build(json.loads(Path(spec_path).read_text()))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
