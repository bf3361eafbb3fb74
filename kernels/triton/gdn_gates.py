"""The GDN gates of a step's tokens in one launch (``kernels.reference.gdn_gates``).

Per (token, value head): ``g = −exp(A_log)·softplus(a + dt_bias)`` in fp32 and ``β = R(sigmoid(b))``
in b's storage dtype, from the input projection's ``a`` and ``b`` columns. The arithmetic is the decode
kernel's prologue (``_gates`` in kernels/triton/gdn_decode.py), so a token's gates are the same bits
here as inside the fused decode step; against the spec's torch ops only the last bits of ``exp`` and
``log1p`` are free. Elementwise: a token's bits never depend on the batch or where it sits. One
launch, no host synchronisation.

``python -m kernels.triton.gdn_gates`` compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.reference import SpecError
from kernels.triton.gdn_decode import _gates
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import (
    check_variants,
    compile_offline,
    pointers_and_strides,
    run_compile_check,
)
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES, interpreted, next_power_of_2

# Tokens per program: every value head of 16 tokens (512 gates at Qwen3.5's 32 heads).
BLOCK_T = 16
NUM_WARPS = 4


class GDNGatesError(SpecError):
    """An input the gates kernel cannot take; the message names the tensor and its value."""


@triton.jit
def _gdn_gates_kernel(
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    tokens,
    stride_a,
    stride_b,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BETA_STORAGE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.arange(0, BLOCK_H)
    head_ok = head < HEADS
    ok = (token[:, None] < tokens) & head_ok[None, :]
    row = token[:, None].to(tl.int64)
    a = tl.load(a_ptr + row * stride_a + head[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + head[None, :], mask=ok, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + head, mask=head_ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head, mask=head_ok, other=0.0).to(tl.float32)
    g, beta = _gates(a, b, a_log[None, :], dt_bias[None, :], BETA_STORAGE, LIBDEVICE)
    out = row * HEADS + head[None, :]
    tl.store(g_ptr + out, g, mask=ok)
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=ok)


_gdn_gates_launch = FastLaunch(_gdn_gates_kernel)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.gdn_gates(a, b, a_log, dt_bias)`` for ``a, b [T, Hv]`` (column views of the
    projection are fine) and ``a_log, dt_bias [Hv]``: ``(g fp32 [T, Hv], β [T, Hv] in b's dtype)``,
    both contiguous."""
    if a.dim() != 2 or b.shape != a.shape:
        raise GDNGatesError(f"a and b must both be [T, Hv], got {list(a.shape)} and {list(b.shape)}")
    tokens, heads = a.shape
    for name, t in (("a", a), ("b", b), ("a_log", a_log), ("dt_bias", dt_bias)):
        if t.dtype not in STORAGE_TYPES:
            raise GDNGatesError(f"{name} must be bf16, fp16 or fp32, got {t.dtype}")
        if t.device != a.device:
            raise GDNGatesError(f"{name} is on {t.device}, a on {a.device}")
    for name, t in (("a_log", a_log), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (heads,):
            raise GDNGatesError(f"{name} must be [{heads}], got {list(t.shape)}")
    if a.device.type != "cuda" and not interpreted():
        raise GDNGatesError(f"device {a.device}: the Triton gates kernel needs CUDA (or TRITON_INTERPRET=1)")
    a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (a, b))
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    g = torch.empty((tokens, heads), dtype=torch.float32, device=a.device)
    beta = torch.empty((tokens, heads), dtype=b.dtype, device=a.device)
    if tokens == 0:
        return g, beta
    _gdn_gates_launch[(ceil_div(tokens, BLOCK_T),)](
        a,
        b,
        a_log,
        dt_bias,
        g,
        beta,
        tokens,
        a.stride(0),
        b.stride(0),
        **_constexprs(heads, b.dtype),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # every multiply and add rounded on its own, as the spec's torch ops
    )
    return g, beta


def _constexprs(heads: int, beta_dtype: torch.dtype) -> dict[str, object]:
    return {
        "HEADS": heads,
        "BLOCK_H": next_power_of_2(heads),
        "BLOCK_T": BLOCK_T,
        "BETA_STORAGE": STORAGE_TYPES[beta_dtype],
        "LIBDEVICE": not interpreted(),
    }


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)

# Qwen3.5's value heads (shared/presets.md: 16 on the 0.8B/2B, 32 on the 4B/9B, 48 on the 27B).
SERVING_HEADS: tuple[int, ...] = (16, 32, 48)


def compile_variant(heads: int, dtype: torch.dtype, arch: int = 90) -> object:
    """The compiled kernel (cubin included) for one variant on ``sm_{arch}``, without a GPU; A_log
    fp32 as the checkpoints store it."""

    def arg_type(name: str) -> str:
        if name in ("a_log_ptr", "g_ptr"):
            return "*fp32"
        if name.endswith("_ptr"):
            return POINTER_TYPES[dtype]
        return "i32"

    return compile_offline(
        _gdn_gates_kernel,
        _constexprs(heads, dtype) | {"LIBDEVICE": True},
        arg_type,
        pointers_and_strides(_gdn_gates_kernel),
        arch=arch,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


def main() -> int:
    return check_variants("gdn_gates", "Hv", SERVING_HEADS, compile_variant)


if __name__ == "__main__":
    run_compile_check(main)
