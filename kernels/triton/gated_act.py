"""The gated MLP activation ``act(gate) · up`` in one launch (``kernels.reference.gated_activation``).

Input is the fused gate/up projection's output ``[rows, 2I]`` (gate first); output ``[rows, I]``.
Each program takes one row's block of ``BLOCK`` columns, so a row's bits never depend on the batch.
The activation is computed in fp32 with libdevice's ``exp`` / ``tanh`` (CUDA's ``expf`` / ``tanhf``,
which torch's kernels call) in torch's operation order, rounded once to the storage dtype, and the
product rounded once, as ``F.silu(gate) * up`` rounds. One launch per call; graph-safe. On sm_90+
it launches with PDL (docs/kernels.md, "PDL"): it reads nothing before its wait, but its launch
overlaps the projection before it and the next kernel may start at once.

``python -m kernels.triton.gated_act`` compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.reference import GatedActivation
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import (
    compile_offline,
    require_pdl_build,
    run_compile_check,
    storage_arg_type,
)
from kernels.triton.prep_kernel import _round_to_storage
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES, interpreted, pdl_supported

_SILU = tl.constexpr(0)
_GELU_TANH = tl.constexpr(1)
_KINDS = {GatedActivation.SILU: _SILU, GatedActivation.GELU_TANH: _GELU_TANH}
# Columns per program: 8 warps × 32 lanes × 4 elements (8-byte bf16 loads).
BLOCK = 1024
# torch's gelu(approximate="tanh") constants: √2 · (2/√π) · ½ and 0.044715.
_GELU_BETA = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)


class GatedActivationError(ValueError):
    """An input the kernel cannot take; the message names the offending shape, dtype or device."""


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.exp(x)
    else:  # the interpreter's exp is numpy's
        return tl.exp(x)


@triton.jit
def _tanh(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.tanh(x)
    else:  # the interpreter has no tanh; this form is exact to a few fp32 ulps
        return 1.0 - tl.div_rn(2.0, tl.exp(2.0 * x) + 1.0)


@triton.jit
def _silu(x, LIBDEVICE: tl.constexpr):
    """``x / (1 + exp(-x))`` in fp32, torch's SiLU on CPU and CUDA: the one definition every kernel
    that applies SiLU uses (the gated activation, the GDN conv step and gated norm)."""
    return tl.div_rn(x, 1.0 + _exp(-x, LIBDEVICE))  # IEEE divide, as CUDA's `/` on floats


@triton.jit
def _gated_product(gate, up, KIND: tl.constexpr, STORAGE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``R(R(act(gate)) · up)`` in fp32 for gate and up already in the storage dtype's values: the
    one definition of the activation every kernel that applies it uses (this one, the fused GEMV)."""
    if KIND == _SILU:
        act = _silu(gate, LIBDEVICE)
    else:
        inner = _GELU_BETA * (gate + _GELU_KAPPA * (gate * gate * gate))
        act = 0.5 * gate * (1.0 + _tanh(inner, LIBDEVICE))
    return _round_to_storage(_round_to_storage(act, STORAGE) * up, STORAGE)


@triton.jit
def _gated_act_kernel(
    gate_up_ptr,
    out_ptr,
    intermediate,
    stride_in,
    stride_out,
    KIND: tl.constexpr,
    STORAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < intermediate
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the down projection may start its weight loads
        tl.extra.cuda.gdc_wait()  # gate and up are the projection's output
    base = gate_up_ptr + row * stride_in
    gate = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(base + intermediate + cols, mask=ok, other=0.0).to(tl.float32)
    y = _gated_product(gate, up, KIND, STORAGE, LIBDEVICE)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


_gated_act_launch = FastLaunch(_gated_act_kernel)


def gated_act(gate_up: torch.Tensor, kind: GatedActivation) -> torch.Tensor:
    """``reference.gated_activation(gate_up, kind)`` for ``gate_up [..., 2I]``; a new ``[..., I]``."""
    width = gate_up.shape[-1]
    if width % 2:
        raise GatedActivationError(f"gate_up last dim {width} is odd: gate and up halves must match")
    if gate_up.dtype not in STORAGE_TYPES:
        raise GatedActivationError(f"dtype {gate_up.dtype}: must be bf16, fp16 or fp32")
    if gate_up.device.type != "cuda" and not interpreted():
        raise GatedActivationError(
            f"device {gate_up.device}: the Triton activation needs CUDA (or TRITON_INTERPRET=1)"
        )
    intermediate = width // 2
    rows = gate_up.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        pdl = pdl_supported(gate_up.device)
        _gated_act_launch[(rows.shape[0], ceil_div(intermediate, BLOCK))](
            rows,
            out,
            intermediate,
            rows.stride(0),
            out.stride(0),
            KIND=_KINDS[kind],
            STORAGE=STORAGE_TYPES[gate_up.dtype],
            BLOCK=BLOCK,
            LIBDEVICE=not interpreted(),
            PDL=pdl,
            num_warps=8,
            enable_fp_fusion=False,  # keep every multiply and add separately rounded, as torch's are
            **({"launch_pdl": True} if pdl else {}),
        )
    return out.reshape(*gate_up.shape[:-1], intermediate)


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)


def compile_variant(kind: GatedActivation, dtype: torch.dtype, arch: int = 90) -> object:
    """The compiled kernel (cubin included) for one variant on ``sm_{arch}``, without a GPU, with
    PDL as it launches there."""
    constexprs = {
        "KIND": _KINDS[kind].value,
        "STORAGE": STORAGE_TYPES[dtype],
        "BLOCK": BLOCK,
        "LIBDEVICE": True,
        "PDL": arch >= 90,
    }
    # Serving shapes have 16-aligned buffers, intermediate sizes and strides, as the JIT specialises.
    return compile_offline(
        _gated_act_kernel,
        constexprs,
        storage_arg_type(dtype),
        _gated_act_kernel.arg_names,
        arch=arch,
        num_warps=8,
        enable_fp_fusion=False,
        launch_pdl=arch >= 90,
    )


def main() -> int:
    for kind in GatedActivation:
        for dtype in POINTER_TYPES:
            require_pdl_build(compile_variant(kind, dtype), f"{kind.value} {dtype}")
        print(f"compiled gated activation {kind.value}")
    return 0


if __name__ == "__main__":
    run_compile_check(main)
