"""Two-level shares from sizes, as the fairseq2 mixture dataset of omnilingual-asr
(``MixtureParquetAsrDataset``, its ``beta_corpus`` / ``beta_language``) computes them: a schedule
like those in :mod:`mixer.mixing.schedule`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mixer import _check
from mixer.errors import ConfigError
from mixer.mixing.schedule import SourceInfo

__all__ = ["Hierarchical"]


@dataclass(frozen=True)
class Hierarchical:
    """Two-level weights from sizes, as ``get_partition_weights_from_betas`` of the fairseq2 mixture
    dataset of omnilingual-asr (``beta_corpus`` / ``beta_language``): a group gets
    ``(size_group / size_total) ** beta_group`` normalised over the groups, a source
    ``(size_source / size_group) ** beta_source`` normalised within its group; the share is the
    product. Beta 0 is uniform (over groups, then within a group), 1 proportional. Groups come from
    ``info.groups``; a source with group None is a group of its own. A source (or group) of size 0
    gets 0 at any beta.
    """

    beta_group: float
    beta_source: float

    def __post_init__(self) -> None:
        _check.number(self.beta_group, "Hierarchical.beta_group", minimum=0, strict=False)
        _check.number(self.beta_source, "Hierarchical.beta_source", minimum=0, strict=False)

    def probs(self, info: SourceInfo, step: int, tokens: float) -> np.ndarray:
        sizes = np.asarray(info.sizes, dtype=np.float64)
        total = sizes.sum()
        if not np.isfinite(total) or total <= 0:
            raise ConfigError(f"source sizes: must have a positive finite sum (got {sizes.tolist()})")
        keys: list[object] = [g if g is not None else ("", i) for i, g in enumerate(info.groups)]
        members: dict[object, list[int]] = {}
        for i, key in enumerate(keys):
            members.setdefault(key, []).append(i)
        group_size = {key: float(sizes[idx].sum()) for key, idx in members.items()}
        # Empty groups and sources get 0 (0 ** 0 would be 1).
        gw = {key: (g / total) ** self.beta_group for key, g in group_size.items() if g > 0}
        gsum = sum(gw.values())
        w = np.zeros(len(sizes))
        for key, idx in members.items():
            if key in gw:
                within = np.array(
                    [(sizes[i] / group_size[key]) ** self.beta_source if sizes[i] > 0 else 0.0 for i in idx]
                )
                w[idx] = gw[key] / gsum * within / within.sum()
        return w
