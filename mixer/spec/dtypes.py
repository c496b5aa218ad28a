"""The element types a batch can hold, by the name a user gives (numpy and torch both)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_DTYPES = {"int32": (np.int32, torch.int32), "int64": (np.int64, torch.int64)}

#: Field dtypes: what numpy and torch both have (no bfloat16: numpy cannot collate it).
FIELD_DTYPES: dict[str, tuple[Any, torch.dtype]] = {
    "int8": (np.int8, torch.int8),
    "int16": (np.int16, torch.int16),
    "int32": (np.int32, torch.int32),
    "int64": (np.int64, torch.int64),
    "uint8": (np.uint8, torch.uint8),
    "float16": (np.float16, torch.float16),
    "float32": (np.float32, torch.float32),
    "float64": (np.float64, torch.float64),
}
