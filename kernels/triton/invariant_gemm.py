"""A batch-invariant GEMM, ``y = x @ w.T``: every output row is computed the same way whatever the
number of rows.

Why it is invariant: the launch configuration (tile sizes, warps, stages) is fixed by the caller
and never looks at the row count; there is no split-K, so each output element is reduced by one
program walking K in the same order, ``BLOCK_K`` columns at a time, into one fp32 accumulator; a
row's products never meet another row's. A row alone or inside any batch therefore sees the same
sequence of fused multiply-adds and the same final rounding, bit for bit.

Graph-safe: one launch per call, no host synchronisation, no data-dependent shapes; the output is
the only allocation. A decode graph holds one GEMM node per projection, not one per row.

Under ``TRITON_INTERPRET=1`` the tiles are cast to fp32 before ``tl.dot`` (the interpreter gets
bf16 dot wrong); on the GPU bf16 and fp16 tiles go to the tensor cores with fp32 accumulation,
and fp32 tiles are multiplied in IEEE fp32 (no TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.triton.launch import FastLaunch
from kernels.triton.storage import interpreted


class GemmShapeError(ValueError):
    """A GEMM the kernel (or the configuration asked for) cannot run; the message names the shape."""


@dataclass(frozen=True, slots=True)
class GemmTiles:
    """One kernel configuration. Every field is fixed at launch and independent of the row count."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # True: K is a multiple of block_k and the K loop loads unmasked (a pinned shape's fast path).
    even_k: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise GemmShapeError(f"{name}={value}: must be a power of two of at least 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise GemmShapeError(f"num_warps={self.num_warps}: must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise GemmShapeError(f"num_stages={self.num_stages}: must be at least 1")

    def runs(self, n: int, k: int) -> str | None:
        """Why this configuration cannot run an [n, k] weight; None when it can."""
        if self.even_k and k % self.block_k:
            return f"K={k} is not a multiple of block_k={self.block_k} (the configuration loads K unmasked)"
        return None


# M is never specialised: one compiled kernel serves every row count (and no capture compiles).
@triton.jit(do_not_specialize=["M"])
def _invariant_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
    w_tile = w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One program owns the whole K range of its tile and walks it in one fixed order.
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_tile, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + ks) < K
            a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:  # noqa: SIM108 (constexpr branch; each arm is its own tl.dot form)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_tile += BLOCK_K * stride_xk
        w_tile += BLOCK_K * stride_wk
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
        y,
        mask=row_ok[:, None] & col_ok[None, :],
    )


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


_invariant_gemm_launch = FastLaunch(_invariant_gemm_kernel)


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, tiles: GemmTiles) -> torch.Tensor:
    """``x @ weight.T`` for x [..., K] and weight [N, K], in x's dtype; one kernel launch."""
    if weight.dim() != 2:
        raise GemmShapeError(f"weight shape {tuple(weight.shape)}: must be 2-D [N, K]")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise GemmShapeError(f"x shape {tuple(x.shape)} does not match weight shape {(n, k)} (K={k})")
    if x.dtype != weight.dtype or x.dtype not in _DTYPES:
        raise GemmShapeError(
            f"dtypes x={x.dtype}, weight={weight.dtype}: must match and be bf16, fp16 or fp32"
        )
    if x.device != weight.device:
        raise GemmShapeError(f"devices x={x.device}, weight={weight.device}: must match")
    if x.device.type != "cuda" and not interpreted():
        raise GemmShapeError(
            f"device {x.device}: the Triton GEMM needs CUDA (or TRITON_INTERPRET=1 for a slow CPU check)"
        )
    why = tiles.runs(n, k)
    if why is not None:
        raise GemmShapeError(f"weight shape {(n, k)}: {why}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    grid = (ceil_div(m, tiles.block_m), ceil_div(n, tiles.block_n))
    _invariant_gemm_launch[grid](
        x2,
        weight,
        y,
        m,
        n,
        k,
        x2.stride(0),
        x2.stride(1),
        weight.stride(0),
        weight.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        EVEN_K=tiles.even_k,
        DOT_FP32=interpreted(),
        IEEE=x.dtype == torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return y.reshape(*lead, n)
