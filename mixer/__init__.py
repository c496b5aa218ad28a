"""mixer: mix WebDataset sources by token share into length-bucketed, token-budget batches.

The distribution is named ``wds-mixer`` on PyPI; the import package is ``mixer``.
"""

from .batch import Batch
from .bucket import TokenBudget, bucket_edges
from .errors import ConfigError, MixerError, SampleError, ShardError, StateError
from .loader import Loader, make_loader
from .mixture import Mixture
from .schedule import Schedule, SourceInfo, Static, Temperature
from .source import Source
from .world import World

__all__ = [
    "Batch",
    "ConfigError",
    "Loader",
    "MixerError",
    "Mixture",
    "SampleError",
    "Schedule",
    "ShardError",
    "Source",
    "SourceInfo",
    "Static",
    "StateError",
    "Temperature",
    "TokenBudget",
    "World",
    "bucket_edges",
    "make_loader",
]
