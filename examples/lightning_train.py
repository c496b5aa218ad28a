"""Lightning training on a mixture, with checkpoints that resume the data stream at the next batch
not trained yet (``mixer.lightning.MixerDataModule``; needs ``pip install 'wds-mixer[lightning]'``).

    python examples/lightning_train.py --steps 20 --ckpt-every 10 --ckpt-dir ckpt
    python examples/lightning_train.py --steps 30 --ckpt-dir ckpt --resume ckpt/step000010.ckpt
    torchrun --nproc_per_node=2 examples/lightning_train.py --devices 2 --steps 20 --ckpt-dir ckpt  # DDP, CPU

Data: ``--source NAME=PATTERN`` (repeatable, equal weights), or the demo sources
(``mixer.cli.demo.ensure_demo_shards()``) by default. Checkpoints: every ``--ckpt-every`` steps
(Lightning's ``ModelCheckpoint``, taken at the end of a training step) and ``last.ckpt`` after
``fit`` returns, in ``--ckpt-dir``; ``--resume`` continues from one, batch for batch. ``--keys-out``
writes one JSON line per step and rank with the keys of the batch trained (what the tests compare).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# [frameworks-lightning-start]
import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import mixer
from mixer.lightning import MixerDataModule


class TinyLM(pl.LightningModule):
    """Next-token prediction from the current token (ids folded into ``vocab``, to stay small)."""

    def __init__(self, vocab: int = 256, dim: int = 32) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def training_step(self, batch: mixer.Batch, batch_idx: int) -> torch.Tensor:
        tokens = batch.tokens.long() % self.vocab
        logits = self.head(self.embed(tokens[:, :-1]))
        # only positions whose next token is a real one (not padding)
        valid = torch.arange(tokens.shape[1] - 1, device=self.device)[None, :] < (batch.lengths[:, None] - 1)
        loss = F.cross_entropy(logits[valid], tokens[:, 1:][valid])
        self.log("loss", loss, batch_size=len(batch))  # Lightning cannot infer a mixer.Batch's size
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def build_mixture(sources: dict[str, str]) -> mixer.Mixture:
    """Called by the data module once Lightning has set up the process group: each rank reads its part."""
    return mixer.Mixture(
        [mixer.Source(name, pattern) for name, pattern in sources.items()],
        batching=mixer.TokenBudget(max_tokens=4096, max_length=1024),
        shuffle_buffer=256,
        seed=0,
    )


def train(
    sources: dict[str, str],
    *,
    steps: int,
    ckpt_dir: Path,
    ckpt_every: int = 0,
    resume: Path | None = None,
    workers: int = 2,
    devices: int = 1,
    callbacks: list[pl.Callback] | None = None,
) -> pl.Trainer:
    data = MixerDataModule(lambda: build_mixture(sources), num_workers=workers)
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=ckpt_every or None,
        save_top_k=-1,  # keep every one
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=steps,
        callbacks=[checkpoints, *(callbacks or [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)  # the same initial weights in every run
    trainer.fit(TinyLM(), datamodule=data, ckpt_path=resume)
    trainer.save_checkpoint(ckpt_dir / "last.ckpt")  # after fit: resumes at the batch after the last one trained
    return trainer


# [frameworks-lightning-end]


class KeysLog(pl.Callback):
    """One JSON line per training step: the step and the keys of the batch it trained."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "keys": list(batch.keys)}) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", action="append", default=[], metavar="NAME=PATTERN", help="a source (repeatable)")
    p.add_argument("--steps", type=int, default=20, help="last step (a resumed run continues up to it)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--devices", type=int, default=1, help="processes (CPU): more than 1 runs DDP (gloo)")
    p.add_argument("--ckpt-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: only last.ckpt)")
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint to continue from")
    p.add_argument("--keys-out", type=Path, default=None, help="a folder: keys-rank<r>.jsonl, one line per step")
    p.add_argument("--cache-dir", default=None, help="demo shard cache (default ~/.cache/mixer/demo)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> pl.Trainer:
    opts = parse_args(argv)
    if opts.source:
        sources = dict(s.split("=", 1) for s in opts.source)
    else:
        from mixer.cli.demo import ensure_demo_shards

        sources = ensure_demo_shards(opts.cache_dir)
    callbacks: list[pl.Callback] = []
    if opts.keys_out is not None:
        opts.keys_out.mkdir(parents=True, exist_ok=True)
        rank = int(os.environ.get("RANK", 0))
        callbacks.append(KeysLog(opts.keys_out / f"keys-rank{rank}.jsonl"))
    return train(
        sources,
        steps=opts.steps,
        ckpt_dir=opts.ckpt_dir,
        ckpt_every=opts.ckpt_every,
        resume=opts.resume,
        workers=opts.workers,
        devices=opts.devices,
        callbacks=callbacks,
    )


if __name__ == "__main__":
    main()
