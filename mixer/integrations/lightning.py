"""A Lightning ``LightningDataModule`` over a mixture whose checkpoints resume the data stream at the
next batch not trained yet (needs the ``lightning`` extra: ``pip install 'wds-mixer[lightning]'``).

Why a data module and not the loader itself: Lightning's training loop fetches the next batch before
it trains the current one (to know whether the current one is the last), and saves the state of the
loaders it iterates at that moment, one batch ahead of what it trained; a mixer loader handed to it
straight therefore refuses to be saved or loaded by it (see :meth:`mixer.Loader.state_dict`).
:class:`MixerDataModule` hands Lightning a stream that keeps the metadata of the last few batches
it handed out, each with the loader's position as of that batch, and saves the position of the
batch whose number is Lightning's own count of the batches its loop has trained
(``fit_loop.epoch_loop.batch_progress.total.processed``, which Lightning restores on resume). So
a checkpoint taken in ``on_train_batch_end`` (``ModelCheckpoint(every_n_train_steps=...)``), at the
end of an epoch or after ``fit`` returned (``trainer.save_checkpoint``) resumes with the first
batch the saving run had not trained, under any strategy that runs one data-parallel replica per
process (single device, DDP): every rank's state is gathered onto rank 0, which writes the
checkpoint (:mod:`mixer.integrations.ranks`). A count that matches none of the batches it keeps
is refused with a :class:`~mixer.StateError` rather than saved approximately.

Lightning epochs are slices of one stream: an epoch that ends before the stream does
(``limit_train_batches``) continues it in the next epoch; the end of a finite mixture's pass ends
the epoch, and the next epoch starts a new pass, as the loader's next ``iter()`` does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError as exc:  # pragma: no cover - the extra is installed where this is tested
    raise ImportError(
        "mixer.lightning needs Lightning: pip install 'wds-mixer[lightning]' (the 'lightning' package, 2.4 or later)"
    ) from exc

from mixer.batching.batch import Batch, BatchMeta
from mixer.errors import ConfigError, StateError
from mixer.integrations.ranks import data_parallel_size, gather
from mixer.mixing.adaptive import Adaptive
from mixer.mixing.mixture import Mixture
from mixer.runtime.loader import Loader, make_loader
from mixer.state import checkpoint

#: Batches handed out whose metadata the stream keeps: Lightning's loop is one batch ahead of its
#: training step; the rest is room for a loop that fetches further ahead.
KEEP = 8


class _TrainStream:
    """What ``train_dataloader`` returns: the loader's batches as one stream over Lightning's epochs,
    numbered on from the count of batches trained when it started, with the last :data:`KEEP`
    batches' metadata by number. No ``state_dict``: Lightning leaves it to the data module."""

    def __init__(self, loader: Loader, *, trained: int, resumed: bool) -> None:
        self.loader = loader
        self.handed = trained  # the number of the last batch handed out
        # before its first batch: where the loader resumes, or None (a new pass)
        self.start = (trained, loader.state_dict() if resumed else None)
        self.ended: int | None = None  # the number of the last batch of a pass that ended
        self.recent: deque[tuple[int, BatchMeta]] = deque(maxlen=KEEP)
        self._batches: Iterator[Batch] | None = None

    def __iter__(self) -> _TrainStream:
        if self._batches is None:
            self._batches = iter(self.loader)
        return self

    def __next__(self) -> Batch:
        if self._batches is None:
            self._batches = iter(self.loader)
        try:
            batch = next(self._batches)
        except StopIteration:
            self._batches, self.ended = None, self.handed  # the next epoch starts a new pass
            raise
        self.handed += 1
        self.recent.append((self.handed, batch.meta))
        return batch

    def state_at(self, trained: int) -> dict[str, Any] | None:
        """This rank's loader state once ``trained`` batches are trained (None: a new pass next)."""
        if trained == self.ended:
            return None
        for number, meta in self.recent:
            if number == trained:
                return self.loader.state_dict(upto=meta)
        if trained == self.start[0]:
            return self.start[1]
        kept = [n for n, _ in self.recent]
        raise StateError(
            f"MixerDataModule: Lightning counts {trained} batches trained, but the data stream holds the position of "
            f"batches {kept or 'none'} (started after batch {self.start[0]}); refusing to save a data position that "
            "would repeat or skip batches (was the checkpoint resumed without this data module's state?)"
        )


class MixerDataModule(pl.LightningDataModule):
    """Training batches of a mixture for Lightning's ``Trainer``, with exact resume (see the module
    docstring): ``trainer.fit(model, datamodule=MixerDataModule(build, num_workers=2))``.

    ``mixture``: a :class:`~mixer.Mixture`, or a function without arguments that builds one, called
    once, when Lightning first asks for the training data (after it has set up the process group,
    so that the mixture reads for this rank: under DDP pass a function). ``group``: the
    data-parallel process group (default: the default group). The other keywords are
    :func:`mixer.make_loader`'s (``sync_group`` defaults to ``group``). ``self.loader`` is the
    :class:`~mixer.Loader` once built, for ``stats()`` and the like.

    The training step receives :class:`~mixer.Batch` objects (``batch.tokens``, ``batch.lengths``,
    ...); Lightning cannot infer their size for ``self.log``, so pass ``batch_size=len(batch)``. A
    ``training_step`` that takes ``dataloader_iter`` fetches batches itself, which Lightning does not
    count, and is refused. Not for an :class:`~mixer.Adaptive` schedule: its feedback state is kept
    as of the last batch handed out only, which under Lightning is not the last batch trained.
    """

    def __init__(self, mixture: Mixture | Callable[[], Mixture], *, group: Any = None, **loader_options: Any) -> None:
        super().__init__()
        if not (isinstance(mixture, Mixture) or callable(mixture)):
            raise ConfigError(
                "MixerDataModule: mixture must be a mixer.Mixture or a function that builds one (got "
                f"{type(mixture).__name__})"
            )
        self._mixture = mixture
        self.group = group
        self.loader_options = {"sync_group": group, **loader_options}
        self.loader: Loader | None = None
        self._stream: _TrainStream | None = None
        self._restored: dict[str, Any] | None = None  # a gathered state, loaded before the stream exists

    def train_dataloader(self) -> _TrainStream:
        """The training stream (the loader built on the first call, restored from a loaded state)."""
        trainer = self.trainer
        model = trainer.lightning_module if trainer is not None else None
        if model is not None and is_param_in_hook_signature(model.training_step, "dataloader_iter", explicit=True):
            raise ConfigError(
                "MixerDataModule: a training_step that takes dataloader_iter fetches batches itself, and Lightning "
                "counts steps, not batches, so the data position to save is unknown; take the batch as an argument"
            )
        if self._stream is None:
            self._stream = self._start()
        return self._stream

    def _start(self) -> _TrainStream:
        mixture = self._mixture if isinstance(self._mixture, Mixture) else self._mixture()
        if not isinstance(mixture, Mixture):
            raise ConfigError(
                f"MixerDataModule: the mixture function returned a {type(mixture).__name__}, not a mixer.Mixture"
            )
        if isinstance(mixture.schedule, Adaptive):
            raise ConfigError(
                "MixerDataModule: an Adaptive schedule's feedback state is kept as of the last batch handed out, and "
                "Lightning trains one batch behind that; use a plain loop with loader.feedback() for adaptive mixing"
            )
        ranks = data_parallel_size(self.group)
        if ranks is not None and (mixture.world_size != ranks):
            raise ConfigError(
                f"MixerDataModule: the mixture reads as rank {mixture.rank} of {mixture.world_size}, but the process "
                f"group has {ranks} data-parallel ranks: pass a function that builds the mixture, so that it is built "
                "once the process group is set up (or give it rank= and world_size=)"
            )
        self.loader = make_loader(mixture, **self.loader_options)
        trained, states = 0, None
        if self._restored is not None:
            trained, states = int(self._restored["trained"]), checkpoint.gathered_states(self._restored)
            if states is not None:
                self.loader.load_state_dict(states)
        return _TrainStream(self.loader, trained=trained, resumed=states is not None)

    def _trained(self, stream: _TrainStream) -> int:
        """Lightning's count of the batches its training loop has trained (all of the stream's
        batches when no trainer is attached)."""
        trainer = self.trainer
        if trainer is None:
            return stream.handed
        try:
            progress: Any = trainer.fit_loop.epoch_loop.batch_progress  # its .total is typed without .processed
            return int(progress.total.processed)
        except AttributeError as exc:
            raise StateError(
                "MixerDataModule: this Lightning version keeps no count of the batches trained where mixer reads it "
                "(trainer.fit_loop.epoch_loop.batch_progress.total.processed); refusing to save a data position "
                "that could be off"
            ) from exc

    def state_dict(self) -> dict[str, Any]:
        """Every rank's data position once the batches Lightning has trained are trained, gathered on
        rank 0 (a collective: Lightning calls it on every rank when it saves a checkpoint)."""
        stream = self._stream
        if stream is None:  # never iterated: what was restored, or nothing (a new start)
            return dict(self._restored) if self._restored is not None else {}
        trained = self._trained(stream)
        world = stream.loader.mixture.world_size
        rank, states = gather(stream.state_at(trained), world_size=world, group=self.group)
        return checkpoint.gathered_state(rank=rank, states=states, trained=trained)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from a state of :meth:`state_dict` (checked now, applied when the loader is built)."""
        checkpoint.gathered_states(state_dict)
        if not isinstance(state_dict.get("trained"), int):
            raise StateError("MixerDataModule: the state must say how many batches were trained ('trained')")
        if self._stream is not None:
            raise StateError("MixerDataModule: load_state_dict must come before Lightning first asks for the data")
        self._restored = dict(state_dict)
