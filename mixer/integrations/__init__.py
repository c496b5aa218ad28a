"""Training frameworks: glue for the loops that fetch batches and write checkpoints themselves.

:class:`AllRanks` (:mod:`mixer.integrations.ranks`) puts every data-parallel rank's loader state in
one checkpoint for frameworks that write it from one process (Accelerate's ``save_state``);
:mod:`mixer.integrations.lightning` is Lightning's data module (``mixer.lightning`` re-exports it),
imported on its own so that ``import mixer`` never imports Lightning.
"""

from mixer.integrations.ranks import AllRanks

__all__ = ["AllRanks"]
