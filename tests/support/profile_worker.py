"""One rank of a `torchrun` job for tests/plan/test_profiling.py (gloo on CPU, 127.0.0.1 only).

    python -m torch.distributed.run --nproc_per_node=N tests/support/profile_worker.py SPEC.json OUT_DIR

SPEC.json lists cases (a name, source URL patterns, ``profile_share``, ``profile_cache``, ``side``:
share over a gloo group of its own as with an NCCL-only group). For each,
in order, every rank builds the Mixture and writes ``OUT_DIR/<case>-rank<r>.json``: each source's
profile (lengths, size, origin) and the bucket edges, or the error the construction raised (its
type and message); the next case still runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

import mixer
import mixer.runtime.distributed


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    sources = [mixer.Source(name, pattern) for name, pattern in case["sources"]]
    handles_cpu = mixer.collective.handles_cpu
    if case.get("side"):  # as with an NCCL-only group: the look is shared over a gloo group of its own
        mixer.collective.handles_cpu = lambda group: False  # type: ignore[assignment]
    try:
        return _build(case, sources)
    finally:
        mixer.collective.handles_cpu = handles_cpu  # type: ignore[assignment]


def _build(case: dict[str, Any], sources: list[mixer.Source]) -> dict[str, Any]:
    try:
        mix = mixer.Mixture(
            sources, batching=mixer.TokenBudget(4096), profile_share=case.get("share"), profile_cache=case.get("cache")
        )
    except Exception as exc:  # noqa: BLE001 (recorded for the test to judge)
        return {"error": [type(exc).__name__, str(exc)]}
    profiles = [{"lengths": p.lengths.tolist(), "size": p.size, "origin": p.origin} for p in mix.profiles]
    return {"profiles": profiles, "edges": mix.edges}


def main() -> int:
    spec_path, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in json.loads(Path(spec_path).read_text())["cases"]:
        (out_dir / f"{case['name']}-rank{rank}.json").write_text(json.dumps(run_case(case)))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
