"""``from mixer.lightning import MixerDataModule``: Lightning's data module over a mixture, with exact
resume (defined in :mod:`mixer.integrations.lightning`; needs the ``lightning`` extra)."""

from mixer.integrations.lightning import MixerDataModule

__all__ = ["MixerDataModule"]
