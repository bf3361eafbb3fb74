"""A batch-invariant RMSNorm: one program per row, the whole row in one tile, reduced in one order.

A row's sum of squares is one `tl.sum` over a tile whose width depends only on the hidden size,
so a row normalised alone or inside any batch takes the same bits. Rounding points are those of
``kernels.reference.rms_norm`` (weight `w` or `1 + w`, optionally rounding before the weight),
through the prep kernel's ``_normalise`` and ``_round_to_storage``. One launch per call; graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import NormSpec, NormWeight
from kernels.triton.invariant_gemm import interpreted
from kernels.triton.prep_kernel import WEIGHT_NONE, WEIGHT_ONE_PLUS_W, WEIGHT_W, _normalise

_MODES = {NormWeight.NONE: WEIGHT_NONE, NormWeight.W: WEIGHT_W, NormWeight.ONE_PLUS_W: WEIGHT_ONE_PLUS_W}
_STORAGE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class NormShapeError(ValueError):
    """An RMSNorm input the kernel cannot take; the message names the offending shape or dtype."""


@triton.jit
def _invariant_rmsnorm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    H,
    stride_x,
    stride_y,
    eps,
    BLOCK_H: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    STORAGE: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)[None, :]
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    mean_square = tl.div_rn(tl.sum(x * x, axis=1), H.to(tl.float32))
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))[:, None]
    if WEIGHT_MODE == WEIGHT_NONE:  # noqa: SIM108 (constexpr branch: no weight pointer to load)
        weight = x
    else:
        weight = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _normalise(x, inv_rms, weight, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE)
    tl.store(y_ptr + row * stride_y + cols, y, mask=ok)


def invariant_rms_norm(x: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., H] over its last dim in x's dtype; the same bits for a row in any batch."""
    if (weight is None) != (spec.weight is NormWeight.NONE):
        raise NormShapeError(
            f"norm weight {spec.weight.value!r} was given weight={None if weight is None else 'tensor'}"
        )
    h = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (h,):
        raise NormShapeError(f"norm weight shape {tuple(weight.shape)} does not match last dim {h}")
    if x.dtype not in _STORAGE:
        raise NormShapeError(f"dtype {x.dtype}: must be bf16, fp16 or fp32")
    if x.device.type != "cuda" and not interpreted():
        raise NormShapeError(f"device {x.device}: the Triton RMSNorm needs CUDA (or TRITON_INTERPRET=1)")
    rows = x.reshape(-1, h)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _invariant_rmsnorm_kernel[(rows.shape[0],)](
            rows,
            rows if weight is None else weight,
            y,
            h,
            rows.stride(0),
            y.stride(0),
            spec.eps,
            BLOCK_H=triton.next_power_of_2(h),
            WEIGHT_MODE=_MODES[spec.weight],
            ROUND_BEFORE_WEIGHT=spec.round_before_weight,
            STORAGE=_STORAGE[x.dtype],
            num_warps=4 if h <= 4096 else 8,
        )
    return y.reshape(x.shape)
