"""Host side of the fused attention-prep kernel: checks, launch geometry, one launch per call.

CUDA-graph safe: given its output buffers, a call reads only tensor metadata on the host (shapes,
strides, dtypes), allocates nothing and never synchronises, so it can be captured as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from kernels.kv_layout import PAGE_SIZE, ceil_div, check_pool_layer
from kernels.reference import NormWeight, PagedRows, PrepSpec, VSource, check_prep_inputs
from kernels.triton.launch import FastLaunch
from kernels.triton.prep_kernel import (
    V_NORMED_PROJECTION,
    V_NORMED_RAW_K,
    V_PROJECTION,
    WEIGHT_NONE,
    WEIGHT_ONE_PLUS_W,
    WEIGHT_W,
    attention_prep_kernel,
)
from kernels.triton.storage import STORAGE_TYPES, next_power_of_2, pdl_supported


class PrepLaunchError(ValueError):
    """Buffers the kernel cannot take; the message names the offending tensor and value."""


_WEIGHT_CODES = {
    NormWeight.NONE: WEIGHT_NONE.value,
    NormWeight.W: WEIGHT_W.value,
    NormWeight.ONE_PLUS_W: WEIGHT_ONE_PLUS_W.value,
}
_V_SOURCE_CODES = {
    VSource.PROJECTION: V_PROJECTION.value,
    VSource.NORMED_PROJECTION: V_NORMED_PROJECTION.value,
    VSource.NORMED_RAW_K: V_NORMED_RAW_K.value,
}


@dataclass(slots=True, frozen=True)
class PrepLaunchConfig:
    """Tile shape: heads per program, chosen so a tile holds about ``tile_elements`` values."""

    tile_elements: int = 1024
    num_warps: int = 4

    def block_heads(self, heads: int, head_dim: int) -> int:
        per_tile = max(1, self.tile_elements // head_dim)
        return min(next_power_of_2(heads), next_power_of_2(per_tile))


DEFAULT_LAUNCH = PrepLaunchConfig()


def blocks_per_row(
    spec: PrepSpec, q_heads: int, kv_heads: int, launch: PrepLaunchConfig = DEFAULT_LAUNCH
) -> tuple[int, int]:
    """Programs per token row: (Q head blocks, KV head blocks)."""
    q_blocks = ceil_div(q_heads, launch.block_heads(q_heads, spec.head_dim))
    return q_blocks, ceil_div(kv_heads, launch.block_heads(kv_heads, spec.head_dim))


def prep_constexprs(
    spec: PrepSpec,
    q_heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    launch: PrepLaunchConfig = DEFAULT_LAUNCH,
    *,
    pdl: bool = False,
) -> dict[str, int | bool | tl.dtype]:
    """The kernel's compile-time parameters for one variant and head count (`pdl`: launched with
    programmatic dependent launch, kernels/triton/storage.py)."""
    return {
        "NUM_Q_HEADS": q_heads,
        "NUM_KV_HEADS": kv_heads,
        "HEAD_DIM": spec.head_dim,
        "Q_BLOCK_HEADS": launch.block_heads(q_heads, spec.head_dim),
        "KV_BLOCK_HEADS": launch.block_heads(kv_heads, spec.head_dim),
        "NUM_Q_BLOCKS": blocks_per_row(spec, q_heads, kv_heads, launch)[0],
        "Q_WEIGHT_MODE": _WEIGHT_CODES[spec.q_norm.weight],
        "Q_ROUND_BEFORE_WEIGHT": spec.q_norm.round_before_weight,
        "K_WEIGHT_MODE": _WEIGHT_CODES[spec.k_norm.weight],
        "K_ROUND_BEFORE_WEIGHT": spec.k_norm.round_before_weight,
        "V_SOURCE": _V_SOURCE_CODES[spec.v_source],
        "Q_GATED": spec.q_gated,
        "TURNING_PAIRS": spec.rope.turning_pairs,
        "PAIR_OFFSET": spec.rope.pair_offset,
        "PAGE_SIZE": PAGE_SIZE,
        "STORAGE": STORAGE_TYPES[dtype],
        "PDL": pdl,
    }


def allocate_prep_outputs(
    spec: PrepSpec, rows: int, q_heads: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q_out`` and (for gated Q) ``gate_out``, each ``[rows, q_heads, head_dim]``."""
    q_out = torch.empty((rows, q_heads, spec.head_dim), dtype=dtype, device=device)
    gate_out = torch.empty_like(q_out) if spec.q_gated else None
    return q_out, gate_out


def _check_rows_buffer(name: str, t: torch.Tensor, needed_rows: int) -> None:
    if t.shape[0] < needed_rows:
        raise PrepLaunchError(f"{name} has {t.shape[0]} rows, the launch reads up to row {needed_rows - 1}")
    if t.stride(-1) != 1:
        raise PrepLaunchError(f"{name} must be dense in its last dim, got strides {t.stride()}")


def _check_index_vector(name: str, t: torch.Tensor, rows: int) -> None:
    """Raise `PrepLaunchError` naming `name` unless `t` is a dense int32 or int64 vector of at least
    `rows` entries (each row's position or sequence index)."""
    if t.dim() != 1 or t.shape[0] < rows:
        raise PrepLaunchError(f"{name} must be 1-D with at least {rows} rows, got {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise PrepLaunchError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.stride(0) != 1:
        raise PrepLaunchError(f"{name} must be contiguous, got stride {t.stride()}")


def _check_rope_table(spec: PrepSpec, rope_table: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise ``PrepLaunchError`` unless ``rope_table`` is ``[positions, 2, turning_pairs]`` in the
    storage dtype, dense in its last dim (what the kernels index)."""
    turning = spec.rope.turning_pairs
    if rope_table.dim() != 3 or tuple(rope_table.shape[1:]) != (2, turning) or rope_table.dtype != dtype:
        raise PrepLaunchError(
            f"rope table must be [positions, 2, {turning}] {dtype}, got "
            f"{tuple(rope_table.shape)} {rope_table.dtype}"
        )
    if rope_table.stride(2) != 1:
        raise PrepLaunchError(f"rope table must be dense in its last dim, got strides {rope_table.stride()}")


def _check_launch(
    spec: PrepSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    rows: PagedRows,
    rope_table: torch.Tensor,
    kv_pool_layer: torch.Tensor,
    q_out: torch.Tensor,
    gate_out: torch.Tensor | None,
    end_row: int,
) -> None:
    if q.dtype not in STORAGE_TYPES:
        raise PrepLaunchError(f"storage dtype {q.dtype} is not one of {sorted(map(str, STORAGE_TYPES))}")
    if spec.head_dim & (spec.head_dim - 1):
        raise PrepLaunchError(f"head_dim must be a power of two for the kernel, got {spec.head_dim}")
    for name, t in (("q", q), ("k", k), ("v", v), ("q_out", q_out), ("gate_out", gate_out)):
        if t is not None:
            _check_rows_buffer(name, t, end_row)
    _check_index_vector("positions", rows.positions, end_row)
    _check_index_vector("seq_index", rows.seq_index, end_row)
    if rows.page_table.dim() != 2 or rows.page_table.stride(1) != 1:
        raise PrepLaunchError(f"page_table must be 2-D, dense per row, got {tuple(rows.page_table.shape)}")
    expected_out = (q.shape[1], spec.head_dim)
    for name, t in (("q_out", q_out), ("gate_out", gate_out)):
        if t is not None and (tuple(t.shape[1:]) != expected_out or t.dtype != q.dtype):
            raise PrepLaunchError(
                f"{name} must be [rows, {expected_out[0]}, {expected_out[1]}] {q.dtype}, got "
                f"{tuple(t.shape)} {t.dtype}"
            )
    if spec.q_gated != (gate_out is not None):
        raise PrepLaunchError(
            f"{spec.name}: gate_out is {'missing' if spec.q_gated else 'given but Q has no gate'}"
        )
    _check_rope_table(spec, rope_table, q.dtype)
    if kv_pool_layer.dtype != q.dtype:
        raise PrepLaunchError(f"pool dtype {kv_pool_layer.dtype} differs from q {q.dtype}")
    devices = {
        t.device
        for t in (q, k, rows.positions, rows.seq_index, rows.page_table, rope_table, kv_pool_layer, q_out)
    }
    if len(devices) != 1:
        raise PrepLaunchError(f"every tensor must be on one device, got {sorted(map(str, devices))}")


_attention_prep_launch = FastLaunch(attention_prep_kernel)


def attention_prep(
    spec: PrepSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    rows: PagedRows,
    rope_table: torch.Tensor,
    kv_pool_layer: torch.Tensor,
    q_out: torch.Tensor,
    gate_out: torch.Tensor | None = None,
    *,
    row_offset: int = 0,
    num_rows: int | None = None,
    launch: PrepLaunchConfig = DEFAULT_LAUNCH,
) -> None:
    """Run ``kernels.reference.attention_prep`` for rows ``[row_offset, row_offset + num_rows)``.

    Every per-row buffer (``q``, ``k``, ``v``, ``rows.positions``, ``rows.seq_index``, ``q_out``,
    ``gate_out``) is indexed by the same absolute row; rows outside the range are neither read nor
    written. ``q``/``k``/``v`` may be strided views (e.g. of a fused QKV projection) as long as
    each head is dense. Positions and page-table entries are trusted (the kernel cannot raise from
    inside a CUDA graph): ``kernels.reference.paged_slots`` states what is valid.
    """
    check_prep_inputs(spec, q, k, v, q_norm_weight, k_norm_weight)
    check_pool_layer(kv_pool_layer, k.shape[1], spec.head_dim)
    if row_offset < 0:
        raise PrepLaunchError(f"row_offset must be non-negative, got {row_offset}")
    count = rows.positions.shape[0] - row_offset if num_rows is None else num_rows
    if count < 0:
        raise PrepLaunchError(f"num_rows must be non-negative, got {count}")
    _check_launch(spec, q, k, v, rows, rope_table, kv_pool_layer, q_out, gate_out, row_offset + count)
    if count == 0:
        return

    q_blocks, kv_blocks = blocks_per_row(spec, q.shape[1], k.shape[1], launch)
    grid = (count, q_blocks + kv_blocks)
    pdl = pdl_supported(q.device)
    # Unused pointers still need a tensor of the right device; they are never dereferenced.
    v_arg = v if v is not None else k
    gate_arg = gate_out if gate_out is not None else q_out
    _attention_prep_launch[grid](
        q,
        k,
        v_arg,
        q_norm_weight,
        k_norm_weight,
        rope_table,
        rows.positions,
        rows.seq_index,
        rows.page_table,
        kv_pool_layer,
        q_out,
        gate_arg,
        row_offset,
        spec.q_norm.eps,
        spec.k_norm.eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v_arg.stride(0),
        v_arg.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        gate_arg.stride(0),
        gate_arg.stride(1),
        rope_table.stride(0),
        rope_table.stride(1),
        rows.page_table.stride(0),
        kv_pool_layer.stride(0),
        kv_pool_layer.stride(1),
        kv_pool_layer.stride(2),
        kv_pool_layer.stride(3),
        **prep_constexprs(spec, q.shape[1], k.shape[1], q.dtype, launch, pdl=pdl),
        num_warps=launch.num_warps,
        **({"launch_pdl": True} if pdl else {}),
        # No fused multiply-add: the reference rounds every product on its own (fp32 storage too).
        enable_fp_fusion=False,
    )
