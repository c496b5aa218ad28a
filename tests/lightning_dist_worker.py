"""Run under torchrun (2 processes, gloo): examples/lightning_train.py's runs for the DDP resume test.

    torchrun --nproc_per_node=2 tests/lightning_dist_worker.py OUT SOURCE=PATTERN ...

For 0 and 2 DataLoader workers, in one process group: an uninterrupted run of 12 steps that
checkpoints every 5 (``full``), a run resumed from its step-5 checkpoint (``from5``), a run stopped
after 7 steps and saved after ``fit`` returned (``short``), and a run resumed from that (``from7``);
each writes ``OUT/w<workers>/<run>/keys-rank<r>.jsonl``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    out, sources = Path(sys.argv[1]), sys.argv[2:]
    spec = importlib.util.spec_from_file_location("lightning_train", HERE.parent / "examples" / "lightning_train.py")
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


if __name__ == "__main__":
    main()
