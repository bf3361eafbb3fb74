"""Chooses the attention-prep implementation for a device: the fused Triton kernel on CUDA, the
spec itself (kernels.reference) elsewhere. Both write K/V into the pool layer in place."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.reference import PagedRows, PrepSpec


def run_attention_prep(
    spec: PrepSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    rows: PagedRows,
    rope_table: torch.Tensor,
    kv_pool_layer: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (q rotated [rows, q_heads, head_dim], gate or None)."""
    if q.device.type != "cuda":
        out = reference.attention_prep(
            spec, q, k, v, q_norm_weight, k_norm_weight, rows, rope_table, kv_pool_layer
        )
        return out.q, out.gate
    from kernels.triton.attention_prep import allocate_prep_outputs, attention_prep

    q_out, gate_out = allocate_prep_outputs(spec, q.shape[0], q.shape[1], q.dtype, q.device)
    attention_prep(
        spec, q, k, v, q_norm_weight, k_norm_weight, rows, rope_table, kv_pool_layer, q_out, gate_out
    )
    return q_out, gate_out
