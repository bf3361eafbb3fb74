"""A batch-invariant RMSNorm: one program per row, the whole row in one tile, reduced in one order.

A row's sum of squares is one `tl.sum` over a tile whose width depends only on the hidden size,
so a row normalised alone or inside any batch takes the same bits. Rounding points are those of
``kernels.reference.rms_norm`` (weight `w` or `1 + w`, optionally rounding before the weight),
through the prep kernel's ``_normalise`` and ``_round_to_storage``. One launch per call; graph-safe.

The same kernel optionally first updates the residual stream (``invariant_add_rms_norm``): it adds
a delta (normalised first when a delta weight is given) and multiplies by a scale when one is given,
each rounded to the storage dtype as torch's ops round, stores that sum, and normalises the stored
value. Its definition is ``kernels.reference.add_rms_norm``; nothing else about the norm changes.

On sm_90+ it launches with PDL (docs/kernels.md, "PDL"): it lets the next kernel start at once, so
the projection after a norm streams its weight while the norm runs, and reads only the norm
weights before it waits for the kernel before it.

``python -m kernels.triton.invariant_rmsnorm`` compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import NormSpec, NormWeight
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import (
    compile_offline,
    pointers_and_strides,
    require_pdl_build,
    run_compile_check,
    storage_arg_type,
)
from kernels.triton.prep_kernel import (
    WEIGHT_NONE,
    WEIGHT_ONE_PLUS_W,
    WEIGHT_W,
    _normalise,
    _round_to_storage,
)
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES, interpreted, next_power_of_2, pdl_supported

_MODES = {NormWeight.NONE: WEIGHT_NONE, NormWeight.W: WEIGHT_W, NormWeight.ONE_PLUS_W: WEIGHT_ONE_PLUS_W}


class NormShapeError(ValueError):
    """An RMSNorm input the kernel cannot take; the message names the offending shape or dtype."""


@triton.jit
def _invariant_rmsnorm_kernel(
    x_ptr,
    delta_ptr,
    delta_w_ptr,
    scale_ptr,
    w_ptr,
    y_ptr,
    sum_ptr,
    H,
    stride_x,
    stride_delta,
    stride_y,
    stride_sum,
    eps,
    BLOCK_H: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    STORAGE: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    DELTA_NORM: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2³¹ elements at long prefills
    cols = tl.arange(0, BLOCK_H)[None, :]
    ok = cols < H
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next projection may start its weight loads
    # Weights first: no kernel of the step writes them, so they are read before the wait.
    if WEIGHT_MODE == WEIGHT_NONE:
        weight = tl.zeros([1, BLOCK_H], dtype=tl.float32)  # unused: _normalise takes no weight
    else:
        weight = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if DELTA_NORM:
        delta_w = tl.load(delta_w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x and delta are earlier kernels' outputs
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0).to(tl.float32)
        if DELTA_NORM:
            delta_inv = _row_inverse_rms(delta, H, eps)
            delta = _normalise(delta, delta_inv, delta_w, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE)
        # torch's `residual + delta` in a 16-bit dtype: one fp32 add, one rounding to storage.
        x = _round_to_storage(x + delta, STORAGE)
        if HAS_SCALE:
            x = _round_to_storage(x * scale, STORAGE)
        # The whole row is loaded above, so sum_ptr may alias x_ptr (an in-place residual update).
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
    inv_rms = _row_inverse_rms(x, H, eps)
    y = _normalise(x, inv_rms, weight, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE)
    tl.store(y_ptr + row * stride_y + cols, y, mask=ok)


@triton.jit
def _row_inverse_rms(x, H, eps):
    """``1 / sqrt(mean(x²) + eps)`` of [R, BLOCK_H] rows (zeros past H), IEEE divide and sqrt."""
    return _inverse_rms_of_sum(tl.sum(x * x, axis=1), H, eps)


@triton.jit
def _inverse_rms_of_sum(sum_squares, H, eps):
    """``1 / sqrt(sum_squares / H + eps)`` as [R, 1] for the [R] sums of squares of rows of width H
    (a kernel that walks a row in K tiles adds the tiles' sums itself), IEEE divide and sqrt."""
    mean_square = tl.div_rn(sum_squares, H.to(tl.float32))
    return tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))[:, None]


def _num_warps(h: int) -> int:
    return 4 if h <= 4096 else 8


def _check_norm(x: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None) -> int:
    """Validate x and the weight against the spec; returns the hidden size."""
    if (weight is None) != (spec.weight is NormWeight.NONE):
        raise NormShapeError(
            f"norm weight {spec.weight.value!r} was given weight={None if weight is None else 'tensor'}"
        )
    h = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (h,):
        raise NormShapeError(f"norm weight shape {tuple(weight.shape)} does not match last dim {h}")
    if weight is not None and weight.stride(-1) != 1:
        raise NormShapeError(f"norm weight stride {weight.stride(-1)}: must be contiguous")
    if x.dtype not in STORAGE_TYPES:
        raise NormShapeError(f"dtype {x.dtype}: must be bf16, fp16 or fp32")
    if x.device.type != "cuda" and not interpreted():
        raise NormShapeError(f"device {x.device}: the Triton RMSNorm needs CUDA (or TRITON_INTERPRET=1)")
    return h


def _input_rows(x: torch.Tensor, h: int) -> torch.Tensor:
    rows = x.reshape(-1, h)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _output_rows(out: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    """``out`` as [rows, H] sharing its storage (so the kernel's writes land in it), or a new buffer."""
    if out is None:
        return torch.empty(like.reshape(-1, like.shape[-1]).shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise NormShapeError(
            f"{name} is {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"expected {tuple(like.shape)} {like.dtype} on {like.device}"
        )
    if out.stride(-1) != 1:
        raise NormShapeError(f"{name} has last-dim stride {out.stride(-1)}: must be 1")
    try:
        return out.view(-1, out.shape[-1])
    except RuntimeError as exc:  # a reshape would copy, and the kernel would write the copy
        raise NormShapeError(f"{name} with strides {out.stride()} cannot be viewed as rows") from exc


_invariant_rmsnorm_launch = FastLaunch(_invariant_rmsnorm_kernel)


def _launch(
    rows: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor | None,
    y: torch.Tensor,
    summed: torch.Tensor | None,
    spec: NormSpec,
    delta_weight: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    if not rows.shape[0]:
        return
    h = rows.shape[1]
    pdl = pdl_supported(rows.device)
    _invariant_rmsnorm_launch[(rows.shape[0],)](
        rows,
        rows if delta is None else delta,  # unread without HAS_DELTA; any valid pointer serves
        rows if delta_weight is None else delta_weight,
        rows if scale is None else scale,
        rows if weight is None else weight,
        y,
        y if summed is None else summed,
        h,
        rows.stride(0),
        rows.stride(0) if delta is None else delta.stride(0),
        y.stride(0),
        y.stride(0) if summed is None else summed.stride(0),
        spec.eps,
        BLOCK_H=next_power_of_2(h),
        WEIGHT_MODE=_MODES[spec.weight],
        ROUND_BEFORE_WEIGHT=spec.round_before_weight,
        STORAGE=STORAGE_TYPES[rows.dtype],
        HAS_DELTA=delta is not None,
        DELTA_NORM=delta_weight is not None,
        HAS_SCALE=scale is not None,
        PDL=pdl,
        num_warps=_num_warps(h),
        enable_fp_fusion=False,  # keep every multiply and add separately rounded, as in the spec
        **({"launch_pdl": True} if pdl else {}),
    )


def invariant_rms_norm(
    x: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [..., H] over its last dim in x's dtype; the same bits for a row in any batch.

    With ``out`` (x's shape and dtype, last dim contiguous) the result is written there and only
    there: rows of a larger buffer outside the view are not touched.
    """
    h = _check_norm(x, spec, weight)
    rows = _input_rows(x, h)
    y = _output_rows(out, x, "out")
    _launch(rows, None, weight, y, None, spec)
    return y.reshape(x.shape) if out is None else out


def invariant_add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor,
    spec: NormSpec,
    weight: torch.Tensor | None = None,
    *,
    delta_weight: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    normed_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.add_rms_norm(residual, delta, spec, weight, delta_weight=, scale=)`` in one launch:
    the new residual and its norm, both in the storage dtype.

    Bit for bit the spec's composition (up to the fp32 order of the sums of squares, as for
    ``invariant_rms_norm``). ``delta_weight`` normalises the delta first with the same spec;
    ``scale`` (one element) multiplies the sum. ``residual_out`` may be ``residual`` itself,
    updating the residual stream in place.
    """
    h = _check_norm(residual, spec, weight)
    if delta.shape != residual.shape or delta.dtype != residual.dtype or delta.device != residual.device:
        raise NormShapeError(
            f"delta is {tuple(delta.shape)} {delta.dtype} on {delta.device}, residual "
            f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
        )
    if delta_weight is not None:
        if spec.weight is NormWeight.NONE:
            raise NormShapeError("delta_weight was given, but the norm spec has no weight")
        _check_norm(delta, spec, delta_weight)
    if scale is not None and (scale.numel() != 1 or scale.dtype != residual.dtype):
        raise NormShapeError(f"scale is {tuple(scale.shape)} {scale.dtype}: one {residual.dtype} element")
    rows = _input_rows(residual, h)
    delta_rows = _input_rows(delta, h)
    summed = _output_rows(residual_out, residual, "residual_out")
    y = _output_rows(normed_out, residual, "normed_out")
    _launch(rows, delta_rows, weight, y, summed, spec, delta_weight, scale)
    new_residual = summed.reshape(residual.shape) if residual_out is None else residual_out
    normed = y.reshape(residual.shape) if normed_out is None else normed_out
    return new_residual, normed


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)

# Every weight kind the spec allows (round_before_weight needs a weight).
COMPILE_SPECS: tuple[NormSpec, ...] = (
    NormSpec(NormWeight.NONE),
    NormSpec(NormWeight.W),
    NormSpec(NormWeight.W, round_before_weight=True),
    NormSpec(NormWeight.ONE_PLUS_W),
    NormSpec(NormWeight.ONE_PLUS_W, round_before_weight=True),
)
# Hidden sizes whose tiles the compile check covers: Qwen3-4B's 2560 (a 4096 tile, 4 warps) and a
# 5120-class hidden (an 8192 tile, 8 warps), the two launch shapes ``_num_warps`` picks between.
COMPILE_HIDDEN: tuple[int, ...] = (2560, 5376)


def compile_variant(
    spec: NormSpec,
    dtype: torch.dtype,
    hidden: int,
    *,
    has_delta: bool,
    delta_norm: bool = False,
    has_scale: bool = False,
    arch: int = 90,
) -> object:
    """The compiled kernel (cubin included) for one variant on ``sm_{arch}``, without a GPU, with
    PDL as it launches there."""
    constexprs = {
        "BLOCK_H": next_power_of_2(hidden),
        "WEIGHT_MODE": _MODES[spec.weight].value,
        "ROUND_BEFORE_WEIGHT": spec.round_before_weight,
        "STORAGE": STORAGE_TYPES[dtype],
        "HAS_DELTA": has_delta,
        "DELTA_NORM": delta_norm,
        "HAS_SCALE": has_scale,
        "PDL": arch >= 90,
    }
    # Buffers from torch are 16-byte aligned and hidden sizes/row strides multiples of 16 at serving
    # shapes, which the runtime JIT specialises on too; without it the loads would not vectorise.
    return compile_offline(
        _invariant_rmsnorm_kernel,
        constexprs,
        storage_arg_type(dtype),
        pointers_and_strides(_invariant_rmsnorm_kernel) | {"H"},
        arch=arch,
        num_warps=_num_warps(hidden),
        enable_fp_fusion=False,
        launch_pdl=arch >= 90,
    )


def main() -> int:
    for has_delta in (False, True):
        for spec in COMPILE_SPECS:
            # Gemma 4's residual steps normalise the delta and scale the sum (they need a weight).
            gemma_steps = has_delta and spec.weight is not NormWeight.NONE
            for delta_norm, has_scale in ((False, False), (True, False), (True, True))[
                : 3 if gemma_steps else 1
            ]:
                for dtype in POINTER_TYPES:
                    for hidden in COMPILE_HIDDEN:
                        kernel = compile_variant(
                            spec,
                            dtype,
                            hidden,
                            has_delta=has_delta,
                            delta_norm=delta_norm,
                            has_scale=has_scale,
                        )
                        require_pdl_build(kernel, f"{spec} {dtype} hidden={hidden}")
                kind = "add_rms_norm" if has_delta else "rms_norm"
                print(
                    f"compiled {kind} weight={spec.weight.value} round_before_weight={spec.round_before_weight}"
                    f" delta_norm={delta_norm} scale={has_scale}"
                )
    return 0


if __name__ == "__main__":
    run_compile_check(main)
