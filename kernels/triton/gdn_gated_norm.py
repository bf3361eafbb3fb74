"""The GDN output norm gated by z (``kernels.reference.gated_rms_norm``) in one launch.

Per (row, value head): ``inv = 1 / sqrt(mean(x²) + eps)`` over the head's V values in fp32 (IEEE
sqrt and divide), ``n = R(x · inv)``, then ``R(n · w · silu(z))`` with the weight and the gate's SiLU
in fp32, multiplied in the spec's order. The spec's rounding points exactly; the free parts are the
fp32 order of the sum of squares and the last bit of ``exp`` inside the SiLU.

Each program owns one row's one head, its whole V in one tile whose width depends on V alone: a
row's bits never depend on the batch. One launch, no host synchronisation: graph-safe.

``python -m kernels.triton.gdn_gated_norm`` compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import SpecError
from kernels.triton.gated_act import _silu
from kernels.triton.invariant_rmsnorm import _row_inverse_rms
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import (
    check_variants,
    compile_offline,
    pointers_and_strides,
    run_compile_check,
)
from kernels.triton.prep_kernel import _round_to_storage
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES, interpreted, next_power_of_2

# The widest head a program holds in one tile (fp32 registers: V values of x and z each).
MAX_VALUE_DIM = 1024
NUM_WARPS = 1


class GDNGatedNormError(SpecError):
    """An input the gated norm kernel cannot take; the message names the tensor and its value."""


@triton.jit
def _gdn_gated_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    stride_x_tok,
    stride_x_head,
    stride_z_tok,
    stride_y_tok,
    value_dim,
    eps,
    BLOCK_V: tl.constexpr,
    STORAGE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_V)[None, :]
    ok = cols < value_dim
    x = tl.load(x_ptr + row * stride_x_tok + head * stride_x_head + cols, mask=ok, other=0.0)
    z = tl.load(z_ptr + row * stride_z_tok + head * value_dim + cols, mask=ok, other=0.0)
    x = x.to(tl.float32)
    normalised = _round_to_storage(x * _row_inverse_rms(x, value_dim, eps), STORAGE)
    weight = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _round_to_storage(normalised * weight * _silu(z.to(tl.float32), LIBDEVICE), STORAGE)
    tl.store(y_ptr + row * stride_y_tok + head * value_dim + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def check_gated_norm(value_dim: int, dtype: torch.dtype) -> None:
    """Refuse, naming the value, a head width or storage dtype the kernel does not take."""
    if not 1 <= value_dim <= MAX_VALUE_DIM:
        raise GDNGatedNormError(f"value head dim {value_dim}: the gated norm kernel takes 1-{MAX_VALUE_DIM}")
    if dtype not in STORAGE_TYPES:
        raise GDNGatedNormError(f"dtype {dtype}: the gated norm kernel takes bf16, fp16 or fp32")


_gdn_gated_norm_launch = FastLaunch(_gdn_gated_norm_kernel)


def gdn_gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference.gated_rms_norm(x, gate, weight, eps)`` for ``x [N, Hv, V]`` (the delta rule's
    output) and ``gate`` of the same shape (a strided view of the projection is fine); ``weight [V]``.
    Returns ``[N, Hv · V]`` in x's dtype, contiguous (the output projection's input)."""
    if x.dim() != 3:
        raise GDNGatedNormError(f"x must be [N, Hv, V], got {list(x.shape)}")
    sequences, heads, value_dim = x.shape
    check_gated_norm(value_dim, x.dtype)
    if gate.shape != x.shape or gate.dtype != x.dtype:
        raise GDNGatedNormError(
            f"gate must be {list(x.shape)} {x.dtype}, got {list(gate.shape)} {gate.dtype}"
        )
    if tuple(weight.shape) != (value_dim,) or weight.dtype not in STORAGE_TYPES:
        raise GDNGatedNormError(
            f"weight must be [{value_dim}] in bf16, fp16 or fp32, got {list(weight.shape)} {weight.dtype}"
        )
    for name, t in (("gate", gate), ("weight", weight)):
        if t.device != x.device:
            raise GDNGatedNormError(f"{name} is on {t.device}, x on {x.device}")
    if x.device.type != "cuda" and not interpreted():
        raise GDNGatedNormError(
            f"device {x.device}: the Triton gated norm needs CUDA (or TRITON_INTERPRET=1)"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    # The gate is read as [N, Hv · V] rows: heads back to back within a row.
    if gate.stride(-1) != 1 or gate.stride(1) != value_dim:
        gate = gate.contiguous()
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    out = torch.empty((sequences, heads * value_dim), dtype=x.dtype, device=x.device)
    if sequences == 0:
        return out
    _gdn_gated_norm_launch[(sequences, heads)](
        x,
        gate,
        weight,
        out,
        x.stride(0),
        x.stride(1),
        gate.stride(0),
        out.stride(0),
        value_dim,
        eps,
        **_constexprs(value_dim, x.dtype),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # every multiply rounded on its own, as the spec's torch ops
    )
    return out


def _constexprs(value_dim: int, dtype: torch.dtype) -> dict[str, object]:
    return {
        "BLOCK_V": next_power_of_2(value_dim),
        "STORAGE": STORAGE_TYPES[dtype],
        "LIBDEVICE": not interpreted(),
    }


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)

# Qwen3.5's value head dim (shared/presets.md: 128 on every preset).
SERVING_VALUE_DIMS: tuple[int, ...] = (128,)


def compile_variant(value_dim: int, dtype: torch.dtype, arch: int = 90) -> object:
    """The compiled kernel (cubin included) for one variant on ``sm_{arch}``, without a GPU; the norm
    weight is fp32, as the checkpoints store it."""

    def arg_type(name: str) -> str:
        if name == "w_ptr":
            return "*fp32"
        if name.endswith("_ptr"):
            return POINTER_TYPES[dtype]
        return "fp32" if name == "eps" else "i32"

    return compile_offline(
        _gdn_gated_norm_kernel,
        _constexprs(value_dim, dtype) | {"LIBDEVICE": True},
        arg_type,
        pointers_and_strides(_gdn_gated_norm_kernel),
        arch=arch,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


def main() -> int:
    return check_variants("gdn_gated_norm", "V", SERVING_VALUE_DIMS, compile_variant)


if __name__ == "__main__":
    run_compile_check(main)
