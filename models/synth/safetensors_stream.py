"""Write safetensors files one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw bytes. Every range follows from the shapes alone, so
the header is written first and each tensor is produced, appended and freed in turn: peak memory
is the largest tensor, not the model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from models.synth.errors import SynthError
from models.synth.tensors import TensorSpec

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _header(specs: Sequence[TensorSpec]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        entries[spec.name] = {
            "dtype": _DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    # The data starts 8-byte aligned.
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    on_written: Callable[[TensorSpec], None],
) -> None:
    header = _header(specs)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(header)))
        out.write(header)
        for spec in specs:
            tensor = produce(spec)
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise SynthError(
                    f"{spec.name}: produced {tuple(tensor.shape)} {tensor.dtype}, planned {spec.shape} {spec.dtype}"
                )
            out.write(tensor.contiguous().view(torch.uint8).numpy().data)
            on_written(spec)


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors packed greedily; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards
