"""Run under torchrun (2 processes, gloo): examples/lightning_train.py's runs for the DDP resume test.

    torchrun --nproc_per_node=2 tests/support/lightning_dist_worker.py OUT SOURCE=PATTERN ...

For 0 and 2 DataLoader workers, in one process group: an uninterrupted run of 12 steps that
checkpoints every 5 (``full``), a run resumed from its step-5 checkpoint (``from5``), a run stopped
after 7 steps and saved after ``fit`` returned (``short``), and a run resumed from that (``from7``);
each writes ``OUT/w<workers>/<run>/keys-rank<r>.jsonl``. Then a Mixture built for one rank is
handed to a 2-rank fit, which must refuse it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> None:
    out, sources = Path(sys.argv[1]), sys.argv[2:]
    spec = importlib.util.spec_from_file_location(
        "lightning_train", HERE.parents[1] / "examples" / "lightning_train.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = [arg for s in sources for arg in ("--source", s)] + ["--devices", "2"]
    for workers in (0, 2):
        base = out / f"w{workers}"

        def run(name: str, *args: str) -> None:
            example.main([*common, "--workers", str(workers), "--keys-out", str(base / name), *args])

        run("full", "--steps", "12", "--ckpt-every", "5", "--ckpt-dir", str(base / "ck-full"))
        run(
            "from5",
            "--steps",
            "12",
            "--ckpt-dir",
            str(base / "ck-from5"),
            "--resume",
            str(base / "ck-full" / "step000005.ckpt"),
        )
        run("short", "--steps", "7", "--ckpt-dir", str(base / "ck-short"))
        run(
            "from7",
            "--steps",
            "12",
            "--ckpt-dir",
            str(base / "ck-from7"),
            "--resume",
            str(base / "ck-short" / "last.ckpt"),
        )
    refuse_a_mixture_built_for_one_rank(example, dict(s.split("=", 1) for s in sources), out)


def refuse_a_mixture_built_for_one_rank(example: Any, sources: dict[str, str], out: Path) -> None:
    """A Mixture built for rank 0 of 1, handed to a 2-rank DDP fit, would make both ranks read the
    same data: refused when the data module builds its loader (the error: OUT/refused-rank<r>.txt)."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    import mixer
    from mixer.errors import ConfigError
    from mixer.lightning import MixerDataModule

    srcs = [mixer.Source(name, pattern) for name, pattern in sources.items()]
    mixture = mixer.Mixture(srcs, batching=mixer.TokenBudget(max_tokens=4096), rank=0, world_size=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    try:
        trainer.fit(example.TinyLM(), datamodule=MixerDataModule(mixture, num_workers=0))
    except ConfigError as exc:
        (out / f"refused-rank{dist.get_rank()}.txt").write_text(str(exc))


if __name__ == "__main__":
    main()
