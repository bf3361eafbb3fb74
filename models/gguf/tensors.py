"""GGUF tensor types: which ones convert, and a tensor's values as a torch tensor.

The numbers are the gguf package's own: `gguf.quants.dequantize` unpacks every block (numpy,
float32 out). This module decides what is supported, restores the row-major shape and hands the
values over to torch; nothing here re-implements a block format.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from models.gguf.deps import import_gguf

# The types a conversion accepts; every one is written and read back by tests/models/test_gguf.py.
SUPPORTED_TYPES: tuple[str, ...] = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

# A float tensor keeps its own type; a quantized one dequantizes to float32, and its values (a
# float16 scale times small integers) are exact there and would round in a 16-bit type.
_SOURCE_DTYPES: dict[str, torch.dtype] = {"F16": torch.float16, "BF16": torch.bfloat16}


def type_name(tensor: Any) -> str:
    return str(tensor.tensor_type.name)


def unsupported(tensor: Any) -> str | None:
    """Why this tensor cannot be converted (naming it and its type), or None."""
    name = type_name(tensor)
    if name in SUPPORTED_TYPES:
        return None
    return f"{tensor.name}: GGUF type {name} is not supported (supported: {', '.join(SUPPORTED_TYPES)})"


def source_dtype(tensor: Any) -> torch.dtype:
    return _SOURCE_DTYPES.get(type_name(tensor), torch.float32)


def row_major_shape(tensor: Any) -> tuple[int, ...]:
    # GGUF lists dimensions innermost first (ggml's ne[0] is the row length).
    return tuple(int(dim) for dim in reversed(tensor.shape))


def dequantized(tensor: Any) -> torch.Tensor:
    """The tensor's values in float32, row-major, as the gguf package dequantizes them."""
    gguf = import_gguf()
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = row_major_shape(tensor)
    # F32 comes back as a view of the read-only file mapping; torch wants memory it may own.
    array = np.array(values, dtype=np.float32, copy=True).reshape(shape)
    return torch.from_numpy(array)
