"""Lightning's Trainer (real, on CPU) with mixer: ``MixerDataModule`` resumes the data stream at the
next batch not trained yet, single process and DDP (2 processes, gloo), with 0 and 2 DataLoader
workers; a loader handed to Lightning straight refuses to be saved or loaded by it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import free_port
from shardutil import LogNormal

import mixer
from mixer.errors import ConfigError, StateError

pl = pytest.importorskip("lightning.pytorch", reason="the 'lightning' extra is not installed")

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "lightning_train.py"
SOURCES = {
    "web": LogNormal(shards=8, samples=1200, median=120, sigma=0.7, lo=8, hi=1024, seed=0),
    "code": LogNormal(shards=4, samples=600, median=300, sigma=0.5, lo=16, hi=1024, seed=1),
}
STEPS, EVERY, SHORT = 12, 5, 7  # the uninterrupted run checkpoints at 5 and 10; the short one stops at 7


@pytest.fixture(scope="module")
def sources(make_sources):
    return {name: pattern for name, (pattern, _) in make_sources(SOURCES).items()}


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("lightning_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys(folder: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (folder / f"keys-rank{rank}.jsonl").read_text().splitlines()]


def _assert_resumed_exactly(out: Path, rank: int = 0) -> None:
    """Every resumed step trained the batch of the same step of the uninterrupted run: from the
    checkpoint ModelCheckpoint took at the end of step 5, and from the one saved after a fit that
    stopped at step 7 (Lightning had fetched batch 8 by then in both cases)."""
    full = _keys(out / "full", rank)
    assert [r["step"] for r in full] == list(range(1, STEPS + 1)) and all(r["keys"] for r in full)
    assert _keys(out / "from5", rank) == full[EVERY:], f"rank {rank}: resumed at step {EVERY + 1} differs"
    assert _keys(out / "short", rank) == full[:SHORT]
    assert _keys(out / "from7", rank) == full[SHORT:], f"rank {rank}: resumed at step {SHORT + 1} differs"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_the_data_module_resumes_at_the_next_untrained_batch(example, sources, tmp_path, workers):
    common = [arg for name, pattern in sources.items() for arg in ("--source", f"{name}={pattern}")]
    common += ["--workers", str(workers)]

    def run(name: str, *args: str) -> None:
        example.main([*common, "--keys-out", str(tmp_path / name), "--ckpt-dir", str(tmp_path / f"ck-{name}"), *args])

    run("full", "--steps", str(STEPS), "--ckpt-every", str(EVERY))
    run("from5", "--steps", str(STEPS), "--resume", str(tmp_path / "ck-full" / f"step{EVERY:06d}.ckpt"))
    run("short", "--steps", str(SHORT))
    run("from7", "--steps", str(STEPS), "--resume", str(tmp_path / "ck-short" / "last.ckpt"))
    _assert_resumed_exactly(tmp_path)


@pytest.mark.slow
def test_the_data_module_resumes_every_ddp_rank_at_the_next_untrained_batch(sources, tmp_path):
    """Lightning's DDP strategy on 2 CPU processes (torchrun, gloo): every rank's position is gathered
    into the one checkpoint rank 0 writes, and every rank resumes from its own."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(HERE.parents[1] / "tests" / "support" / "lightning_dist_worker.py"),
        str(tmp_path),
        *(f"{name}={pattern}" for name, pattern in sources.items()),
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            [str(HERE.parents[1]), str(HERE.parent / "support"), os.environ.get("PYTHONPATH", "")]
        ),
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for workers in (0, 2):
        for rank in (0, 1):
            _assert_resumed_exactly(tmp_path / f"w{workers}", rank)
        first = [set(_keys(tmp_path / f"w{workers}" / "full", rank)[0]["keys"]) for rank in (0, 1)]
        assert not first[0] & first[1], "the two ranks must read different samples"
    for rank in (0, 1):  # a Mixture built for one rank, handed to a 2-rank fit
        refused = (tmp_path / f"refused-rank{rank}.txt").read_text()
        assert "the mixture reads as rank 0 of 1, but the process group has 2 data-parallel ranks" in refused


class _Steps(pl.LightningModule):
    """The smallest module that trains on a mixer batch."""

    def __init__(self) -> None:
        super().__init__()
        import torch

        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.weight * batch.lengths.float().mean()) ** 2

    def configure_optimizers(self):
        import torch

        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(tmp_path: Path, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kw,
    )


def test_a_loader_handed_straight_to_lightning_refuses_its_checkpoint(sources, tmp_path):
    """Lightning saves a loader's own state after fetching the next batch (the state would skip it on
    resume) and loads such states into it: both are refused with a clear error, never done."""
    mixture = mixer.Mixture(
        [mixer.Source(n, p) for n, p in sources.items()], batching=mixer.TokenBudget(max_tokens=2048)
    )

    class Raw(_Steps):
        def train_dataloader(self):
            return mixer.make_loader(mixture)

    every = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    with pytest.raises(StateError, match=r"handed straight to Lightning's Trainer cannot save .* skip a batch"):
        _trainer(tmp_path, callbacks=[every]).fit(Raw())
    from lightning.pytorch.utilities import CombinedLoader

    loader = mixer.make_loader(mixture)
    state = loader.state_dict()  # the user's own call saves, as before
    with pytest.raises(StateError, match="cannot load its state exactly"):
        CombinedLoader(loader)._load_state_dicts([state])  # what Lightning runs on resume


def test_the_data_module_refuses_what_it_cannot_save_exactly(sources, tmp_path):
    def build(**kw):
        return lambda: mixer.Mixture(
            [mixer.Source(n, p) for n, p in sources.items()], batching=mixer.TokenBudget(max_tokens=2048), **kw
        )

    from mixer.lightning import MixerDataModule

    class Iterating(_Steps):
        def training_step(self, dataloader_iter):
            return super().training_step(next(dataloader_iter)[0], 0)

    with pytest.raises(ConfigError, match="training_step that takes dataloader_iter"):
        _trainer(tmp_path).fit(Iterating(), datamodule=MixerDataModule(build()))
    adaptive = mixer.Adaptive(mixer.Weights({n: 1.0 for n in sources}))
    with pytest.raises(ConfigError, match="an Adaptive schedule's feedback state"):
        _trainer(tmp_path).fit(_Steps(), datamodule=MixerDataModule(build(schedule=adaptive)))
    with pytest.raises(ConfigError, match="must be a mixer.Mixture or a function that builds one"):
        MixerDataModule("web")  # type: ignore[arg-type]
    # a checkpoint whose loop progress does not match the data module's position is not saved
    data = MixerDataModule(build())
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    trainer.fit(_Steps(), datamodule=data)
    trainer.fit_loop.epoch_loop.batch_progress.total.processed = 100  # as if resumed without the data's state
    with pytest.raises(
        StateError, match=r"Lightning counts 100 batches trained, but the data stream holds the position of batches \["
    ):
        trainer.save_checkpoint(tmp_path / "x.ckpt")


class _Keys(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, list[str]]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.seen.append((trainer.current_epoch, trainer.global_step, list(batch.keys)))


@pytest.mark.slow
def test_a_finite_pass_ends_the_epoch_and_the_next_epoch_starts_a_new_pass(make_sources, tmp_path):
    """stop="all_exhausted": each epoch is one pass; resumed from a checkpoint taken mid-epoch and
    from one taken at the end of the first epoch, the run trains what the uninterrupted one did."""
    from mixer.lightning import MixerDataModule

    small = make_sources({"tiny": LogNormal(shards=2, samples=96, median=100, sigma=0.5, lo=8, hi=512, seed=3)})
    pattern = small["tiny"][0]

    def build() -> mixer.Mixture:
        return mixer.Mixture(
            [mixer.Source("tiny", pattern)], batching=mixer.TokenBudget(max_tokens=2048), stop="all_exhausted"
        )

    def fit(name: str, resume: Path | None = None) -> list[tuple[int, int, list[str]]]:
        keys = _Keys()
        every = pl.callbacks.ModelCheckpoint(
            dirpath=tmp_path / name,
            filename="step{step}",
            every_n_train_steps=3,
            save_top_k=-1,
            auto_insert_metric_name=False,
        )
        epochs = pl.callbacks.ModelCheckpoint(
            dirpath=tmp_path / name,
            filename="epoch{epoch}",
            every_n_epochs=1,
            save_top_k=-1,
            auto_insert_metric_name=False,
            save_on_train_epoch_end=True,
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[keys, every, epochs],
        )
        trainer.fit(_Steps(), datamodule=MixerDataModule(build, num_workers=2), ckpt_path=resume)
        return keys.seen

    full = fit("full")
    per_epoch = [[k for e, _, k in full if e == epoch] for epoch in (0, 1)]
    assert len(per_epoch[0]) > 3 and per_epoch[0] == per_epoch[1]  # a new pass: the same batches again
    first = len(per_epoch[0])
    assert fit("mid", tmp_path / "full" / "step3.ckpt") == full[3:]
    assert fit("boundary", tmp_path / "full" / "epoch0.ckpt") == full[first:]
