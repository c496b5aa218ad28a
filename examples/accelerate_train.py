"""Accelerate training on a mixture, with the data stream's position in ``accelerator.save_state``
(``pip install accelerate``).

    python examples/accelerate_train.py --steps 20 --ckpt-every 10 --ckpt-dir ckpt
    python examples/accelerate_train.py --steps 30 --ckpt-dir ckpt --resume ckpt/step-000010
    torchrun --nproc_per_node=2 examples/accelerate_train.py --steps 20 --ckpt-every 10 --ckpt-dir ckpt  # CPU

Data: ``--source NAME=PATTERN`` (repeatable, equal weights), or the demo sources
(``mixer.cli.demo.ensure_demo_shards()``) by default. Every ``--ckpt-every`` steps
``accelerator.save_state`` writes ``--ckpt-dir/step-XXXXXX`` (model, optimizer, random generators and
the objects registered for checkpointing: here the loader and the step count); ``--resume`` loads
one and continues batch for batch. ``--keys-out`` writes one JSON line per step and process with the
keys of the batch trained (what the tests compare).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# [frameworks-accelerate-start]
import torch
import torch.nn.functional as F
from accelerate import Accelerator

import mixer
from mixer.integrations import AllRanks


class StepCount:
    """The step, saved with the checkpoint (Accelerate saves any object with state_dict/load_state_dict)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def train(
    sources: dict[str, str],
    *,
    steps: int,
    ckpt_dir: Path,
    ckpt_every: int = 0,
    resume: Path | None = None,
    workers: int = 2,
    log: Any = None,
) -> None:
    # Sets up the process group under torchrun / accelerate launch; on CPUs only with cpu=True (gloo).
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    mixture = mixer.Mixture(  # built after it: each process reads its own part of every source
        [mixer.Source(name, pattern) for name, pattern in sources.items()],
        batching=mixer.TokenBudget(max_tokens=4096, max_length=1024),
        shuffle_buffer=256,
        seed=0,
    )
    # Not accelerator.prepare(loader): the mixture already splits the data by rank.
    loader = mixer.make_loader(mixture, num_workers=workers, device=accelerator.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optim = accelerator.prepare(model, optim)
    count = StepCount()
    # Accelerate writes registered objects from the main process only: with several processes,
    # AllRanks gathers every rank's loader state into that one file.
    accelerator.register_for_checkpointing(loader if accelerator.num_processes == 1 else AllRanks(loader), count)
    if resume is not None:
        accelerator.load_state(resume)
    batches = iter(loader)
    while count.step < steps:
        # Fetch a batch only when a step will train it: the loader's state is as of the last batch handed out.
        batch = next(batches, None)
        if batch is None:  # the end of a finite mixture's pass
            break
        count.step += 1
        tokens = batch.tokens.long() % 256
        logits = model(tokens[:, :-1])
        valid = torch.arange(tokens.shape[1] - 1, device=tokens.device)[None, :] < (batch.lengths[:, None] - 1)
        loss = F.cross_entropy(logits[valid], tokens[:, 1:][valid])
        accelerator.backward(loss)
        optim.step()
        optim.zero_grad()
        if log is not None:
            log(accelerator.process_index, count.step, batch)
        if ckpt_every and count.step % ckpt_every == 0:
            accelerator.save_state(ckpt_dir / f"step-{count.step:06d}")


# [frameworks-accelerate-end]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", action="append", default=[], metavar="NAME=PATTERN", help="a source (repeatable)")
    p.add_argument("--steps", type=int, default=20, help="last step (a resumed run continues up to it)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per process")
    p.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint folder (ckpt-dir/step-XXXXXX)")
    p.add_argument("--keys-out", type=Path, default=None, help="a folder: keys-rank<r>.jsonl, one line per step")
    p.add_argument("--cache-dir", default=None, help="demo shard cache (default ~/.cache/mixer/demo)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.source:
        sources = dict(s.split("=", 1) for s in opts.source)
    else:
        from mixer.cli.demo import ensure_demo_shards

        sources = ensure_demo_shards(opts.cache_dir)
    log = None
    if opts.keys_out is not None:
        folder: Path = opts.keys_out
        folder.mkdir(parents=True, exist_ok=True)

        def log(rank: int, step: int, batch: mixer.Batch) -> None:
            with open(folder / f"keys-rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "keys": list(batch.keys)}) + "\n")

    train(
        sources,
        steps=opts.steps,
        ckpt_dir=opts.ckpt_dir,
        ckpt_every=opts.ckpt_every,
        resume=opts.resume,
        workers=opts.workers,
        log=log,
    )


if __name__ == "__main__":
    main()
