"""What llama.cpp's converter did to each architecture's tensors, so it can be undone.

Names: the gguf package's `TensorNameMap` states the GGUF name of every Hugging Face tensor; it is
asked about each name the transformers model has, and the answers are turned around. Values: two
architecture facts of llama.cpp's `convert_hf_to_gguf.py` — Gemma's RMSNorm weights are stored
with the 1 of `(1 + w)` added, and Llama's q/k rows are interleaved for its RoPE. Everything else
is stored as Hugging Face has it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.gguf.deps import import_gguf
from models.gguf.errors import GGUFError


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # `general.architecture`
    norm_offset: float  # subtracted from every `*norm.weight`
    interleaved_qk: bool  # attn_q / attn_k rows were permuted for llama.cpp's RoPE


ARCHITECTURES: dict[str, Architecture] = {
    "gemma3": Architecture("gemma3", norm_offset=1.0, interleaved_qk=False),
    "llama": Architecture("llama", norm_offset=0.0, interleaved_qk=True),
    "qwen3": Architecture("qwen3", norm_offset=0.0, interleaved_qk=False),
}


def architecture(path: Path, name: str) -> Architecture:
    found = ARCHITECTURES.get(name)
    if found is None:
        raise GGUFError(
            f"{path}: general.architecture {name!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return found


@dataclass(frozen=True, slots=True)
class NameMatch:
    hf_of_gguf: dict[str, str]  # GGUF tensor name -> Hugging Face tensor name
    problems: tuple[str, ...]  # Hugging Face tensors the table has no GGUF name for, or two share


def match_names(arch: Architecture, num_layers: int, hf_names: Iterable[str]) -> NameMatch:
    gguf = import_gguf()
    arch_id = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch.name), None)
    if arch_id is None:
        raise GGUFError(f"gguf {gguf.__name__} knows no architecture {arch.name!r}; upgrade the gguf package")
    table = gguf.get_tensor_name_map(arch_id, num_layers)
    hf_of_gguf: dict[str, str] = {}
    problems: list[str] = []
    for hf_name in hf_names:
        gguf_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            problems.append(f"{hf_name}: the gguf name table has no GGUF tensor for it")
        elif gguf_name in hf_of_gguf:
            problems.append(f"{hf_name}: GGUF tensor {gguf_name} already stands for {hf_of_gguf[gguf_name]}")
        else:
            hf_of_gguf[gguf_name] = hf_name
    return NameMatch(hf_of_gguf, tuple(problems))


def _deinterleave_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp stores each head's rotary pairs side by side (row 2i, 2i+1); Hugging Face keeps the
    # two halves of a head apart (row i, i + head_dim/2).
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def hf_values(
    arch: Architecture, gguf_name: str, values: torch.Tensor, config: Mapping[str, Any]
) -> torch.Tensor:
    """The Hugging Face tensor for GGUF tensor `gguf_name` (float32 in, float32 out)."""
    if arch.norm_offset and gguf_name.endswith("norm.weight"):
        values = values - arch.norm_offset
    if arch.interleaved_qk and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        key = "num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"
        heads = config.get(key)
        if not isinstance(heads, int) or heads <= 0:
            raise GGUFError(f"{gguf_name}: config field {key!r} is needed to restore the row order")
        values = _deinterleave_rows(values, heads)
    return values
