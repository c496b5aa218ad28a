"""One rank of a `torchrun` job for tests/runtime/test_adaptive_dist.py (gloo on CPU, 127.0.0.1 only).

    python -m torch.distributed.run --nproc_per_node=N tests/support/adaptive_worker.py SPEC.json OUT_DIR

Every rank builds the same adaptive mixture (rank and world size from the process group) and takes
``steps`` batches with ``num_workers`` workers, reporting a loss per sample that depends on the rank
(so the ranks' windows differ and only the all-reduce makes them agree). ``OUT_DIR/rank<r>.json``
holds, per step, the target the batch carried, its sources and real tokens per source, and at the
end the adaptive part of ``stats()``; then:

- ``mode="agree"``: rank ``victim`` stops reporting losses after ``at`` batches but keeps training;
  every rank then replays each cut in ``cuts`` (a fresh loader, the state saved at that batch) and
  records what the resumed loader hands out;
- ``mode="hang"``: rank ``victim`` stops handing out batches after ``at`` (a hung training step: it
  sleeps until every other rank has written its result, ``hang_s`` at most), and every other rank
  records the error its loop ended with and how long after its last batch it came
  (``make_loader(sync_timeout=timeout)``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from waiting import wait_for_files

import mixer


def hang_until_the_others_are_done(out: Path, rank: int, most_s: float) -> None:
    """A hung step: no batch for the others until each has given up and written its result (they must
    raise within their ``sync_timeout``, well below ``most_s``), then on to the end. Waiting on their
    files instead of a fixed sleep ends the job seconds after the others raise."""
    wait_for_files([out / f"rank{r}.json" for r in range(dist.get_world_size()) if r != rank], most_s)


def loss_of(batch: Any, rank: int) -> Any:
    return (batch.source.double() + 1) * (rank + 1) + batch.lengths.double() / 1000


def record(batch: Any, names: int) -> dict[str, Any]:
    tokens = [0] * names
    for s, n in zip(batch.source.tolist(), batch.lengths.tolist()):
        tokens[s] += n
    return {
        "step": batch.meta.step,
        "target": batch.meta.target,
        "sources": batch.source.tolist(),
        "keys": list(batch.keys),
        "tokens": tokens,
    }


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    patterns = spec["patterns"]
    sources = [mixer.Source(name, pattern, weight=w) for name, (pattern, w) in patterns.items()]
    schedule = mixer.Adaptive(
        mixer.Weights({n: w for n, (_, w) in patterns.items()}),
        policy=spec.get("policy", "exp_gradient"),
        lr=4.0,
        update_every=4,
        smoothing=0.1,
    )
    mix = mixer.Mixture(
        sources,
        batching=mixer.TokenBudget(max_tokens=spec["max_tokens"]),
        schedule=schedule,
        shuffle_buffer=32,
        state_every=4,
    )

    def loader() -> mixer.Loader:
        return mixer.make_loader(mix, num_workers=spec["num_workers"], sync_timeout=spec.get("timeout", 600))

    result: dict[str, Any] = {"rank": rank, "steps": [], "states": {}, "error": None}
    victim = rank == spec.get("victim")
    first = loader()
    last = time.monotonic()
    try:
        for batch in first:
            result["steps"].append(record(batch, len(sources)))
            taken = len(result["steps"])
            if victim and taken >= spec["at"]:
                if spec["mode"] == "hang":
                    hang_until_the_others_are_done(out, rank, spec["hang_s"])
                    break
            else:
                first.feedback(batch, loss_of(batch, rank))
            if str(taken) in map(str, spec.get("cuts", [])):  # as a checkpoint after the step would
                result["states"][str(taken)] = json.loads(json.dumps(first.state_dict()))
            last = time.monotonic()
            if taken == spec["steps"]:
                break
    except Exception as exc:  # recorded for the test to judge
        result["error"] = {"type": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - last}
    result["adaptive"] = first.stats()["adaptive"]
    if spec["mode"] == "agree":
        result["resumed"] = {}
        for cut in spec["cuts"]:
            again = loader()
            again.load_state_dict(result["states"][str(cut)])
            got = result["resumed"][str(cut)] = []
            for batch in again:
                got.append(record(batch, len(sources)))
                if not (victim and cut + len(got) >= spec["at"]):
                    again.feedback(batch, loss_of(batch, rank))
                if cut + len(got) == spec["steps"]:
                    break
    del result["states"]
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if spec["mode"] == "agree":
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
