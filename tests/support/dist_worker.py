"""One rank of a `torchrun` job for tests/runtime/test_distributed.py (gloo on CPU, 127.0.0.1 only).

    python -m torch.distributed.run --nproc_per_node=N tests/support/dist_worker.py SPEC.json OUT_DIR run|resume

SPEC.json lists cases (sources, stop policy, num_workers, sync_stop, sync_end, where to save a
state). For each case, in order, every rank builds the Mixture (rank and world size from the process
group), iterates its loader to the end and writes ``OUT_DIR/<case>-<phase>-rank<r>.json``: per batch
the keys, the source of each sample and a digest of the tensors (a filler batch: only that it is one
and has rows, since its contents are a copy), plus ``loader.sync_report()`` and what ``stats()``
counted. In the ``run`` phase the loader state after batch ``save_at`` goes to
``OUT_DIR/<case>-rank<r>.state.pt`` (torch.save); ``save_at="tail"`` saves after every one of the
pass's last ``tail`` batches (and after its last), and the resume phase continues from each of them to
the end; ``save_at="filler"`` picks the batch count at which the first rank handed out its first
filler (agreed over the ranks after the pass), so the state is saved inside that rank's filler phase.
The ``resume`` phase loads it into a fresh loader and records the continuation. A case whose stream
raises records the error instead, and the next case still runs (every rank took part in the same
collectives up to the failure).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import mixer
import mixer.runtime.distributed

# The "fail" case: decoding raises on one rank once armed (after the Mixture profiled its sources).
ARMED = {"on_rank": -1, "after": 0, "count": 0}


def failing_decode(sample: dict[str, Any]) -> np.ndarray:
    if dist.get_rank() == ARMED["on_rank"]:
        ARMED["count"] += 1
        if ARMED["count"] > ARMED["after"]:
            raise RuntimeError(f"injected read failure on rank {ARMED['on_rank']}")
    return np.load(io.BytesIO(sample["tokens.npy"]))


def build(case: dict[str, Any]) -> mixer.Loader:
    decode = failing_decode if case.get("fail_rank") is not None else None
    sources = [mixer.Source(s["name"], s["pattern"], weight=s["weight"], decode=decode) for s in case["sources"]]
    mix = mixer.Mixture(
        sources,
        batching=mixer.TokenBudget(max_tokens=case["max_tokens"]),
        stop=case["stop"],
        seed=case.get("seed", 0),
        shuffle_buffer=case.get("shuffle_buffer", 16),
        state_every=case.get("state_every", 4),
    )
    group = None
    if case.get("group") == "explicit":  # the data-parallel group passed as sync_group
        group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    handles_cpu = mixer.collective.handles_cpu
    if case.get("group") == "side":  # as with an NCCL-only group: the loader makes its own gloo group
        mixer.collective.handles_cpu = lambda group: False  # type: ignore[assignment]
    try:
        return mixer.make_loader(
            mix,
            num_workers=case["num_workers"],
            sync_stop=case.get("sync_stop"),
            sync_end=case.get("sync_end", "pad"),
            sync_group=group,
        )
    finally:
        mixer.collective.handles_cpu = handles_cpu  # type: ignore[assignment]


def view(batch: mixer.Batch) -> dict[str, Any]:
    if batch.filler:
        return {"filler": True, "rows": len(batch) > 0 and batch.num_tokens > 0}
    digest = hashlib.blake2b(batch.buffer.numpy().tobytes(), digest_size=8).hexdigest()
    return {
        "filler": False,
        "keys": list(batch.keys),
        "source": batch.source.tolist(),
        "step": batch.meta.step,
        "digest": digest,
    }


def run_case(case: dict[str, Any], out: Path, phase: str, rank: int) -> dict[str, Any]:
    ARMED.update(on_rank=-1)
    loader = build(case)
    if case.get("fail_rank") is not None:  # armed after the Mixture read its sources' profiles
        ARMED.update(on_rank=case["fail_rank"], after=case["fail_after"], count=0)
    state_path = out / f"{case['name']}-rank{rank}.state.pt"
    save_at = case.get("save_at")
    if phase == "resume" and save_at == "tail":
        return resume_tail(case, state_path, rank)
    if phase == "resume":
        loader.load_state_dict(torch.load(state_path, weights_only=True))
    batches: list[dict[str, Any]] = []
    result: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size(), "batches": batches}
    states: dict[int, dict[str, Any]] = {}
    try:
        for batch in loader:
            batches.append(view(batch))
            if phase == "run" and save_at in ("filler", "tail"):
                states[len(batches)] = loader.state_dict()
            elif phase == "run" and len(batches) == save_at:
                torch.save(loader.state_dict(), state_path)
    except Exception as exc:  # recorded for the test to judge
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    if phase == "run" and save_at == "filler":
        first = next((k for k, b in enumerate(batches, 1) if b["filler"]), len(batches) + 1)
        agreed = torch.tensor([first])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        result["save_at"] = k = int(agreed.item())
        torch.save(states[k], state_path)
    if phase == "run" and save_at == "tail":  # every cut of the last `tail` batches, and after the last
        cuts = range(max(0, len(batches) - case["tail"]), len(batches) + 1)
        torch.save({k: states[k] if k else None for k in cuts}, state_path)
    report = loader.sync_report()
    result["dropped"] = report["dropped"]
    result["fillers"] = report["fillers"]
    result["sync_end"] = report["sync_end"]
    stats = loader.stats()
    result["stats"] = {
        "fillers": stats["fillers"],
        "batches": stats["batches"],
        "samples": {name: s["total"]["samples"] for name, s in stats["sources"].items()},
    }
    result["synced"] = loader.sync is not None
    return result


def resume_tail(case: dict[str, Any], state_path: Path, rank: int) -> dict[str, Any]:
    """The ``tail`` case's resume phase: from each saved cut, a fresh loader to the end of the pass."""
    saved = torch.load(state_path, weights_only=True)
    continued: dict[str, list[dict[str, Any]]] = {}
    for cut in sorted(saved):
        loader = build(case)
        if saved[cut] is not None:
            loader.load_state_dict(saved[cut])
        continued[str(cut)] = [view(batch) for batch in loader]
    return {"rank": rank, "world_size": dist.get_world_size(), "tail": continued}


def main() -> int:
    spec_path, out_dir, phase = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert rank == int(os.environ["RANK"])
    for case in json.loads(Path(spec_path).read_text())["cases"]:
        if phase == "resume" and not case.get("save_at"):
            continue
        if case.get("world", dist.get_world_size()) != dist.get_world_size():
            continue
        result = run_case(case, out_dir, phase, rank)
        (out_dir / f"{case['name']}-{phase}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
