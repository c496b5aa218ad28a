"""The element types a batch can hold, by the name a user gives (numpy and torch both)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_DTYPES = {"int32": (np.int32, torch.int32), "int64": (np.int64, torch.int64)}

#: Field dtypes, as (the numpy dtype a collate writes, the torch dtype of the batch's view). numpy has
#: no bfloat16: its values are written as their 16 bits (`bfloat16_bits`) and viewed as torch.bfloat16.
FIELD_DTYPES: dict[str, tuple[Any, torch.dtype]] = {
    "int8": (np.int8, torch.int8),
    "int16": (np.int16, torch.int16),
    "int32": (np.int32, torch.int32),
    "int64": (np.int64, torch.int64),
    "uint8": (np.uint8, torch.uint8),
    "float16": (np.float16, torch.float16),
    "bfloat16": (np.uint16, torch.bfloat16),
    "float32": (np.float32, torch.float32),
    "float64": (np.float64, torch.float64),
}


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 nearest to each value (round to nearest, ties to even, as torch converts), as its
    16 bits in a uint16 array; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


def cast_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a field's values are cast to before they are written (float32 for bfloat16)."""
    return np.dtype(np.float32) if name == "bfloat16" else np.dtype(FIELD_DTYPES[name][0])
