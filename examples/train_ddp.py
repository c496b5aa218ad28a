"""A small but real DDP training loop on mixed tokens, with exact checkpoint/resume of the data stream.

    torchrun --nproc_per_node=2 examples/train_ddp.py --steps 20                      # CPU, gloo
    torchrun --nproc_per_node=2 examples/train_ddp.py --steps 20 --ckpt-every 10 --ckpt-dir ckpt
    torchrun --nproc_per_node=2 examples/train_ddp.py --steps 20 --resume ckpt/step-000010
    torchrun --nproc_per_node=8 examples/train_ddp.py --device cuda --steps 1000      # GPUs, nccl

Data: the built-in demo sources (`mixer.cli.demo.ensure_demo_shards()`: byte-level tokens, vocabulary
256) mixed 50/30/20 into token-budget batches, or ``--config`` a mixer YAML file. Every rank builds
the same Mixture; rank and world size come from the process group, so each rank reads its own
disjoint part of every source. With ``--stop all_exhausted`` (default) the run makes one pass over
the data and every rank takes the same number of steps: the loader agrees on the end with one
``all_reduce`` per batch, and a rank whose data ended first gets *filler* batches (``batch.filler``)
until every rank has ended, so every sample is trained on exactly once. A filler step still runs
forward and backward (DDP's gradient all-reduce needs every rank) with its loss multiplied by 0, so
it adds nothing to the gradient; the count is in ``loader.sync_report()``. ``--stop never`` streams
forever and ``--steps`` ends the run.

Model: a tiny causal LM (token embedding, a causal depthwise convolution over the last 4 tokens,
GELU, a linear head) predicting each next token, under ``DistributedDataParallel``.

Checkpoints (``--ckpt-every N`` steps, into ``--ckpt-dir``): a folder ``step-XXXXXX`` with
``model.pt`` (model, optimizer, step; written by rank 0: DDP keeps every rank's copy equal) and one
``data-rank<r>.pt`` per rank: ``loader.state_dict()``, the position of *that rank's* stream as of the
last batch it handed out. ``--resume`` loads both, and the run continues batch for batch (and, on
CPU, loss for loss) as if it had never stopped. Resuming needs the same world size, ``--workers``
and data configuration (the loader refuses anything else with a clear error).

``--log-dir`` writes one JSON line per step and rank (step, loss, tokens, a digest of the batch).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (imported before the process group exists: see main())
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mixer

log = logging.getLogger("train_ddp")
VOCAB = 256  # the demo's byte-level tokens
DEMO_WEIGHTS = {"prose": 0.5, "code": 0.3, "books": 0.2}


class TinyLM(nn.Module):
    """Next-token prediction from the last ``context`` tokens: embedding, causal depthwise conv, head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, context: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.context = context
        self.conv = nn.Conv1d(dim, dim, kernel_size=context, groups=dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(1, 2)  # [B, D, L]
        x = self.conv(F.pad(x, (self.context - 1, 0)))  # position t sees tokens t-3..t only
        return self.head(F.gelu(x).transpose(1, 2))  # [B, L, V]


def lm_loss(model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from tokens <= t, over real (non-pad) positions."""
    logits = model(tokens[:, :-1].long())
    targets = tokens[:, 1:].long()
    valid = torch.arange(targets.shape[1], device=tokens.device)[None, :] < (lengths[:, None] - 1)
    return F.cross_entropy(logits[valid], targets[valid])


def build_mixture(opts: argparse.Namespace) -> mixer.Mixture:
    if opts.config:
        return mixer.load_config(opts.config)
    from mixer.cli.demo import ensure_demo_shards

    patterns = ensure_demo_shards(opts.cache_dir)
    sources = [mixer.Source(name, patterns[name], weight=w) for name, w in DEMO_WEIGHTS.items()]
    budget = mixer.TokenBudget(max_tokens=opts.max_tokens, max_length=opts.max_tokens)
    return mixer.Mixture(sources, batching=budget, stop=opts.stop, seed=opts.seed, shuffle_buffer=256)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="last step (a resumed run continues up to it)")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: nccl, one GPU per rank (LOCAL_RANK)"
    )
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--max-tokens", type=int, default=8192, help="token budget per batch (longer samples are cut)")
    p.add_argument("--stop", choices=("never", "first_exhausted", "all_exhausted"), default="all_exhausted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--config", default=None, help="a mixer YAML config instead of the demo data")
    p.add_argument("--cache-dir", default=None, help="demo shard cache (default ~/.cache/mixer/demo)")
    p.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint folder (ckpt-dir/step-XXXXXX)")
    p.add_argument("--log-dir", type=Path, default=None, help="per-rank JSON lines: step, loss, tokens, batch digest")
    p.add_argument("--log-every", type=int, default=5)
    return p.parse_args(argv)


def save_checkpoint(
    folder: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer, loader: mixer.Loader
) -> None:
    rank = dist.get_rank()
    folder.mkdir(parents=True, exist_ok=True)
    # Each rank's data position is its own; the model and optimizer are equal on every rank.
    torch.save({"step": step, "data": loader.state_dict()}, folder / f"data-rank{rank}.pt")
    if rank == 0:
        torch.save({"step": step, "model": model.state_dict(), "optim": optim.state_dict()}, folder / "model.pt")
    dist.barrier()


def load_checkpoint(
    folder: Path, model: nn.Module, optim: torch.optim.Optimizer, loader: mixer.Loader, device: torch.device
) -> int:
    rank = dist.get_rank()
    state = torch.load(folder / "model.pt", map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    data = torch.load(folder / f"data-rank{rank}.pt", weights_only=True)
    if data["step"] != state["step"]:
        raise RuntimeError(
            f"{folder}: data state of rank {rank} is from step {data['step']}, the model from step {state['step']}"
        )
    loader.load_state_dict(data["data"])
    return int(state["step"])


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    train(opts, device)
    # Everything that refers to the process group (DDP, the loader's rank sync) was made in train() and is
    # gone now: collect what cycles kept, so that destroying the group joins its backend threads while the
    # interpreter still runs. Left to interpreter shutdown, a gloo thread that still holds the last
    # all_reduce of the final backward (a loaded machine can keep it waiting that long) releases it after
    # Python has begun to exit, and the process aborts ("terminate called without an active exception").
    # The group is freed only if nothing else holds it: torch.distributed.nn binds `group.WORLD` as default
    # arguments when it is first imported, and DDP imports it (through torch._dynamo) on construction, so
    # it is imported at the top of this file, while no group exists yet.
    gc.collect()
    dist.destroy_process_group()
    return 0


def train(opts: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank}: %(message)s")

    mixture = build_mixture(opts)  # rank and world size from the process group
    loader = mixer.make_loader(mixture, num_workers=opts.workers, device=device if device.type == "cuda" else None)
    torch.manual_seed(opts.seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = TinyLM().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optim = torch.optim.AdamW(ddp.parameters(), lr=opts.lr)
    step = 0
    if opts.resume is not None:
        step = load_checkpoint(opts.resume, model, optim, loader, device)
        log.info("resumed from %s at step %d", opts.resume, step)

    log_file = None
    if opts.log_dir is not None:
        opts.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(opts.log_dir / f"rank{rank}.jsonl", "a")
    started = time.perf_counter()
    batches = iter(loader)
    while step < opts.steps:
        # Ask for a batch only when a step will use it: the loader's state counts what it handed out.
        batch = next(batches, None)
        if batch is None:  # end of a finite pass: every rank ends here at the same step
            break
        step += 1
        loss = lm_loss(ddp, batch.tokens, batch.lengths)
        if batch.filler:  # a copy of a real batch that only keeps this rank in step: no gradient from it
            loss = loss * 0
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        value = float(loss.detach())  # one host sync per step, as a loop that logs its loss has
        if log_file is not None:
            digest = hashlib.blake2b(batch.buffer.cpu().numpy().tobytes(), digest_size=8).hexdigest()
            if batch.filler:  # trains on nothing
                record = {"step": step, "loss": value, "tokens": 0, "keys": 0, "filler": True}
            else:
                record = {
                    "step": step,
                    "loss": value,
                    "tokens": batch.num_tokens,
                    "keys": len(batch.keys),
                    "digest": digest,
                }
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        if rank == 0 and (step % opts.log_every == 0 or step == 1):
            log.info("step %d loss %.4f (%d tokens, %s)", step, value, batch.num_tokens, batch)
        if opts.ckpt_every and step % opts.ckpt_every == 0:
            save_checkpoint(opts.ckpt_dir / f"step-{step:06d}", step, model, optim, loader)
    report = loader.sync_report()
    if report["fillers"]:
        log.info(
            "end of the pass: %d filler step(s) (loss weighed by 0) to keep every rank at %d steps",
            report["fillers"],
            step,
        )
    log.info("done: %d steps in %.1f s (world size %d)", step, time.perf_counter() - started, world)
    if log_file is not None:
        log_file.close()


if __name__ == "__main__":
    sys.exit(main())
