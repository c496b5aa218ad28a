"""mixer: mix WebDataset sources by token share into length-bucketed, token-budget batches.

The distribution is named ``wds-mixer`` on PyPI; the import package is ``mixer``.
"""

from .adaptive import Adaptive
from .audio import SpeechDecode
from .batch import Batch, BatchMeta, FieldBatch, PackedBatch
from .budget import Field, Packed, TokenBudget
from .device import to_device
from .errors import ConfigError, MixerError, SampleError, ShardError, StateError
from .storage import IOOptions
from .loader import Loader, make_loader
from .mixture import Mixture
from .config import MixtureConfig, build_mixture, load_config, parse_config
from .hierarchical import Hierarchical
from .index import build_index, load_index
from .schedule import Curriculum, Floored, Phase, Schedule, SourceInfo, Static, Temperature, Weights
from .source import Source
from .stats import log_every

__all__ = [
    "Adaptive",
    "Batch",
    "BatchMeta",
    "ConfigError",
    "Curriculum",
    "Field",
    "FieldBatch",
    "Floored",
    "Hierarchical",
    "IOOptions",
    "Loader",
    "MixerError",
    "Mixture",
    "MixtureConfig",
    "Packed",
    "PackedBatch",
    "Phase",
    "SampleError",
    "Schedule",
    "ShardError",
    "Source",
    "SourceInfo",
    "SpeechDecode",
    "StateError",
    "Static",
    "Temperature",
    "TokenBudget",
    "Weights",
    "build_index",
    "build_mixture",
    "load_config",
    "load_index",
    "log_every",
    "make_loader",
    "parse_config",
    "to_device",
]
