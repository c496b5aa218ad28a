"""Every data-parallel rank's loader state in one checkpoint, for frameworks that write a checkpoint
from one process.

Lightning's Trainer and Accelerate's ``save_state`` each collect the state to save on every process
but write it from the main one only, so a loader's own state (one rank's position) would reach the
checkpoint for rank 0 alone, and every other rank would resume from rank 0's state (which
``load_state_dict`` refuses: the rank differs). :class:`AllRanks` gathers the loader states of all
the ranks onto rank 0 of the data-parallel group (one ``gather_object`` per save, called on every
rank: both frameworks collect on every process), and its ``load_state_dict`` hands the whole list to
:meth:`mixer.Loader.load_state_dict`, which takes this rank's own state when the world size and
``num_workers`` are those of the saved run, and re-splits elastically otherwise. The format is
:func:`mixer.state.checkpoint.gathered_state`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mixer.errors import ConfigError
from mixer.state import checkpoint

if TYPE_CHECKING:
    from mixer.batching.batch import Batch, BatchMeta
    from mixer.runtime.loader import Loader


def data_parallel_size(group: Any = None) -> int | None:
    """The size of ``group`` (default: the default group), or None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return int(dist.get_world_size(group))


def gather(local: Any, *, world_size: int, group: Any = None) -> tuple[int, list[Any] | None]:
    """``(this rank in group, [local of every rank of group, in group-rank order])`` on group rank 0,
    ``(rank, None)`` on the others; ``(0, [local])`` without a process group. A collective: every
    rank of ``group`` (default: the default group) must call it. ``world_size``: the number of
    data-parallel ranks the mixture reads for, which the group must have."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if world_size != 1:
            raise ConfigError(
                f"the mixture reads for {world_size} ranks, but no process group is initialized to gather their states"
            )
        return 0, [local]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != world_size:
        raise ConfigError(
            f"the process group has {size} ranks, the mixture reads for {world_size} data-parallel ranks: pass the "
            "data-parallel group (group=...) to gather the loader states over"
        )
    out: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(local, out, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return rank, out


class AllRanks:
    """A loader seen as one stateful object for all the data-parallel ranks: register it where a
    framework wants something with ``state_dict`` / ``load_state_dict`` and writes it from the main
    process only (``accelerator.register_for_checkpointing(AllRanks(loader))``).

    ``state_dict(upto=None)`` is a collective (every rank calls it; frameworks do): rank 0 of
    ``group`` gets every rank's ``loader.state_dict(upto=upto)``, the others a placeholder that
    ``load_state_dict`` refuses by name. ``load_state_dict`` resumes every rank from the list (exact
    for the saved world size and ``num_workers``, elastic otherwise, see :mod:`mixer.mixing.elastic`).
    ``group``: the data-parallel group (default: the default group)."""

    def __init__(self, loader: Loader, *, group: Any = None) -> None:
        self.loader = loader
        self.group = group

    def state_dict(self, upto: Batch | BatchMeta | None = None) -> dict[str, Any]:
        rank, states = gather(
            self.loader.state_dict(upto=upto), world_size=self.loader.mixture.world_size, group=self.group
        )
        return checkpoint.gathered_state(rank=rank, states=states, trained=None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = checkpoint.gathered_states(state)
        if states is not None:
            self.loader.load_state_dict(states)
