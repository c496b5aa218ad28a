"""mixer: mix WebDataset sources by token share into length-bucketed, token-budget batches.

The distribution is named ``wds-mixer`` on PyPI; the import package is ``mixer``.
"""

from mixer.batching.batch import Batch, BatchMeta, FieldBatch, PackedBatch
from mixer.config.mixture_config import MixtureConfig, build_mixture, load_config, parse_config
from mixer.errors import ConfigError, MixerError, SampleError, ShardError, StateError
from mixer.mixing.adaptive import Adaptive
from mixer.mixing.hierarchical import Hierarchical
from mixer.mixing.mixture import Mixture
from mixer.mixing.schedule import Curriculum, Floored, Phase, Schedule, SourceInfo, Static, Temperature, Weights
from mixer.observe.stats import log_every
from mixer.plan.index import build_index, load_index
from mixer.plan.pretokenize import pretokenize
from mixer.read.audio import SpeechDecode
from mixer.read.text import TextDecode
from mixer.runtime.device import to_device
from mixer.runtime.loader import Loader, make_loader
from mixer.spec.budget import Field, Packed, TokenBudget
from mixer.spec.source import Source
from mixer.storage import IOOptions

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
    "TextDecode",
    "TokenBudget",
    "Weights",
    "build_index",
    "build_mixture",
    "load_config",
    "load_index",
    "log_every",
    "make_loader",
    "parse_config",
    "pretokenize",
    "to_device",
]
