"""One decode step of the GDN causal conv with SiLU, reading and shifting the conv state pool in place.

``kernels.reference.causal_conv1d`` with one token per sequence: the inputs are the slot's W − 1
stored inputs (zeros for a fresh sequence, whatever its slot holds) followed by the new token;
``y = R(silu(R(Σ_j w[:, j] · x_j)))`` with the products and their sum in fp32, added in the spec's
order (j = 0 … W − 1, each product rounded, no FMA), so the sum is the spec's bit for bit and the
only freedom left is the last bit of fp32 ``exp`` inside the SiLU. The slot then holds the last W − 1
inputs: its rows shift up by one and the token becomes the last row.

Each program owns one row and ``BLOCK_D`` channels. A channel's conv reads only that channel, so a
row's bits never depend on the batch or on where the row sits. A program loads each state row
before it overwrites it, and every element is loaded and stored by the same thread (``BLOCK_D`` is a
multiple of the program's thread count, so no element is held twice): the in-place shift needs no
second buffer. Slots must be distinct except for the padding slot 0, which CUDA-graph filler rows
share and nothing reads. One launch, no host synchronisation: graph-safe.

``python -m kernels.triton.gdn_conv_step`` compiles every variant for sm_90 without a GPU.
docs/kernels.md, "Gated DeltaNet", tells where it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.reference import SpecError
from kernels.triton.gated_act import _silu
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import (
    check_variants,
    compile_offline,
    pointers_and_strides,
    run_compile_check,
)
from kernels.triton.prep_kernel import _round_to_storage
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES, interpreted

# Channels per program: 2 warps × 32 lanes × 4 elements. At Qwen3.5-4B's conv_dim 8192 a batch-1 step
# has 32 programs; the whole step moves 8192 × (2·(W − 1) + 2) elements, so launch latency dominates.
BLOCK_D = 256
NUM_WARPS = 2
# Conv widths the kernel takes (Qwen3.5: 4). A width of 1 has no state; wider ones are untested.
WIDTHS = (2, 3, 4)


class GDNConvError(SpecError):
    """An input the GDN conv kernels (the step here, the varlen prefill in gdn_conv_varlen.py) cannot
    take; the message names the tensor and its value."""


@triton.jit
def _gdn_conv_step_kernel(
    x_ptr,
    w_ptr,
    slots_ptr,
    fresh_ptr,
    pool_ptr,
    y_ptr,
    channels,
    stride_x_tok,
    stride_w_chan,
    stride_pool_slot,
    stride_pool_row,
    stride_y_tok,
    WIDTH: tl.constexpr,
    STORAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < channels
    slot = tl.load(slots_ptr + row).to(tl.int64)
    fresh = tl.load(fresh_ptr + row)
    # A fresh row's slot is not read at all (the mask broadcast to the block, as the interpreter
    # takes no scalar term in a mask).
    keep = ok & ((tl.zeros([BLOCK_D], dtype=tl.int32) + (fresh == 0).to(tl.int32)) != 0)
    state = pool_ptr + slot * stride_pool_slot + cols
    weights = w_ptr + cols * stride_w_chan
    token = tl.load(x_ptr + row * stride_x_tok + cols, mask=ok, other=0.0)

    # The sum starts from +0 as torch's does (an all-zero window sums to +0, whatever the weights' signs).
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc = acc + tl.load(state, mask=keep, other=0.0).to(tl.float32) * tl.load(weights, mask=ok).to(tl.float32)
    for j in tl.static_range(1, WIDTH - 1):
        held = tl.load(state + j * stride_pool_row, mask=keep, other=0.0)
        acc = acc + held.to(tl.float32) * tl.load(weights + j, mask=ok).to(tl.float32)
        # Row j moves up to row j − 1, which this thread loaded an iteration ago.
        tl.store(state + (j - 1) * stride_pool_row, held, mask=ok)
    acc = acc + token.to(tl.float32) * tl.load(weights + (WIDTH - 1), mask=ok).to(tl.float32)
    tl.store(state + (WIDTH - 2) * stride_pool_row, token, mask=ok)

    conv = _round_to_storage(acc, STORAGE)
    y = _round_to_storage(_silu(conv, LIBDEVICE), STORAGE)
    tl.store(y_ptr + row * stride_y_tok + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise GDNConvError(f"{name} is on {t.device}, the conv state pool on {device}")


def check_conv_kernels(channels: int, width: int, dtype: torch.dtype) -> None:
    """Refuse, naming the value, a conv the Triton conv kernels do not take: its width or storage dtype."""
    if width not in WIDTHS:
        raise GDNConvError(f"conv width {width}: the Triton conv kernels take {', '.join(map(str, WIDTHS))}")
    if dtype not in STORAGE_TYPES:
        raise GDNConvError(f"conv dtype {dtype}: the Triton conv kernels take bf16, fp16 or fp32")
    if channels < 1:
        raise GDNConvError(f"conv channels {channels}: must be positive")


def check_conv_inputs(
    x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, conv_pool: torch.Tensor
) -> tuple[int, int]:
    """What both conv kernels ask of their operands, refused by name: ``x [T, D]``, ``weight [D, W]``
    contiguous, ``slots [N]`` int64, ``fresh [N]`` bool, ``conv_pool [slots, W − 1, D]`` in x's
    dtype with contiguous channels, all on the pool's device, which is CUDA (or the interpreter runs).
    Returns ``(D, W)``."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise GDNConvError(
            f"x [T, D] and weight [D, W] must share D, got {list(x.shape)}, {list(weight.shape)}"
        )
    channels, width = weight.shape
    check_conv_kernels(channels, width, x.dtype)
    device = conv_pool.device
    if conv_pool.dim() != 3 or tuple(conv_pool.shape[1:]) != (width - 1, channels):
        raise GDNConvError(f"conv_pool must be [slots, {width - 1}, {channels}], got {list(conv_pool.shape)}")
    if conv_pool.dtype != x.dtype:
        raise GDNConvError(f"conv_pool is {conv_pool.dtype}, x {x.dtype}: they must match")
    if weight.dtype not in STORAGE_TYPES:
        raise GDNConvError(f"weight dtype {weight.dtype}: must be bf16, fp16 or fp32")
    if conv_pool.stride(-1) != 1 or weight.stride(0) != width or weight.stride(1) != 1:
        raise GDNConvError(
            f"conv_pool's channels and weight [D, W] must be contiguous, got strides "
            f"{conv_pool.stride()} and {weight.stride()}"
        )
    if slots.dim() != 1 or tuple(fresh.shape) != tuple(slots.shape):
        raise GDNConvError(f"slots and fresh must be [N], got {list(slots.shape)}, {list(fresh.shape)}")
    if slots.dtype != torch.int64 or fresh.dtype != torch.bool:
        raise GDNConvError(f"slots must be int64 and fresh bool, got {slots.dtype}, {fresh.dtype}")
    for name, t in (("x", x), ("weight", weight), ("slots", slots), ("fresh", fresh)):
        _check_device(name, t, device)
    if device.type != "cuda" and not interpreted():
        raise GDNConvError(f"device {device}: the Triton conv kernels need CUDA (or TRITON_INTERPRET=1)")
    return channels, width


_gdn_conv_step_launch = FastLaunch(_gdn_conv_step_kernel)


def gdn_conv_step(
    x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, conv_pool: torch.Tensor
) -> torch.Tensor:
    """One token per sequence: ``x [N, D]`` (a strided row view is fine), ``weight [D, W]``,
    ``slots [N]`` int64, ``fresh [N]`` bool, ``conv_pool [slots, W − 1, D]`` in x's dtype, shifted
    in place. Returns ``y [N, D]`` in x's dtype, contiguous."""
    channels, width = check_conv_inputs(x, weight, slots, fresh, conv_pool)
    sequences = x.shape[0]
    if tuple(slots.shape) != (sequences,):
        raise GDNConvError(
            f"slots and fresh must be [{sequences}], one per token of x, got {list(slots.shape)}"
        )
    device = conv_pool.device
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((sequences, channels), dtype=x.dtype, device=device)
    if sequences == 0:
        return out
    _gdn_conv_step_launch[(sequences, ceil_div(channels, BLOCK_D))](
        x,
        weight,
        slots,
        fresh.view(torch.uint8),  # a byte per row: the interpreter takes no bool mask from a bool load
        conv_pool,
        out,
        channels,
        x.stride(0),
        weight.stride(0),
        conv_pool.stride(0),
        conv_pool.stride(1),
        out.stride(0),
        **_constexprs(width, x.dtype),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # every product and sum rounded on its own, as the spec's torch ops
    )
    return out


def _constexprs(width: int, dtype: torch.dtype) -> dict[str, object]:
    return {
        "WIDTH": width,
        "STORAGE": STORAGE_TYPES[dtype],
        "BLOCK_D": BLOCK_D,
        "LIBDEVICE": not interpreted(),
    }


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)

# Qwen3.5's conv width (shared/presets.md: 4 on every preset).
SERVING_WIDTHS: tuple[int, ...] = (4,)


# The conv kernels' index pointers (this one's and gdn_conv_varlen's); every other pointer has the
# storage dtype.
_INDEX_POINTERS = {"bounds_ptr": "*i64", "slots_ptr": "*i64", "fresh_ptr": "*u8"}


def compile_conv_kernel(
    kernel: triton.JITFunction, constexprs: dict[str, object], dtype: torch.dtype, arch: int, num_warps: int
) -> object:
    """One of the conv kernels (this step, or the varlen prefill in gdn_conv_varlen.py) compiled,
    cubin included, for ``sm_{arch}`` without a GPU."""

    def arg_type(name: str) -> str:
        if name.endswith("_ptr"):
            return _INDEX_POINTERS.get(name, POINTER_TYPES[dtype])
        return "i32"

    # Serving shapes: 16-byte aligned buffers, channel counts and strides that are multiples of 16
    # elements, except the weight's channel stride (W) and the per-row ``fresh`` bytes.
    return compile_offline(
        kernel,
        constexprs | {"LIBDEVICE": True},
        arg_type,
        (pointers_and_strides(kernel) | {"channels"}) - {"fresh_ptr", "stride_w_chan"},
        arch=arch,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )


def compile_variant(width: int, dtype: torch.dtype, arch: int = 90) -> object:
    """The compiled kernel (cubin included) for one variant on ``sm_{arch}``, without a GPU."""
    return compile_conv_kernel(_gdn_conv_step_kernel, _constexprs(width, dtype), dtype, arch, NUM_WARPS)


def main() -> int:
    return check_variants("gdn_conv_step", "W", SERVING_WIDTHS, compile_variant)


if __name__ == "__main__":
    run_compile_check(main)
