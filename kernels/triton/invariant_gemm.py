"""A batch-invariant GEMM, ``y = x @ w.T``: every output row is computed the same way whatever the
number of rows (docs/numerics.md, "The invariant GEMM").

Why it is invariant: the launch configuration (tile sizes, warps, stages) is fixed by the caller
and never looks at the row count, and so is the cut of K (``GemmTiles.k_split``: a function of the
weight shape alone). Each output element is the sum, in the fixed order 0, 1, …, of its K chunks'
partial sums, each chunk walked ``BLOCK_K`` columns at a time into its own fp32 accumulator from
zero, and rounded once to the storage dtype; a row's products never meet another row's. A row alone
or inside any batch therefore sees the same sequence of multiply-adds and adds, bit for bit.

Where the chunks are summed is a launch choice that changes no bit:

* **within a program** (``PARTIAL`` off): one program per output tile walks every chunk and adds
  each chunk's partial into a running fp32 total as it ends it. Used when the row blocks alone
  fill ``GemmTiles.split_programs`` programs (prefill), and always without a split;
* **across programs** (``PARTIAL`` on): one program per (tile, chunk) writes its chunk's fp32
  partial to a scratch ``[M, splits, N]``, and the skinny GEMM's reduce kernel
  (``skinny_gemm.reduce_partials``) adds them in the same order, from the same zero, with the same
  rounding. Used at few rows, where one program per tile would leave most SMs idle (at one row
  Qwen3-4B's O and down projections have 40 tiles of 64 columns for 132 SMs).

The tiles' rows and columns may grow with the row count (``GemmTiles.many_rows``, and
``many_rows_cut`` where K is cut; prefill) and change no bit: the K chunks and the ``block_k`` steps
through them stay the same, and a row's sums do not depend on how many rows and columns a tile holds
beside it (measured, not documented by the hardware: docs/benchmarks/invariance.md; the GPU tests
hold rows to it across the switch).

Graph-safe: no host synchronisation, no data-dependent shapes; the output and the split scratch are
the only allocations. A decode graph holds one GEMM node per projection, plus a reduce node where
the projection's K is split. PDL on sm_90+ (kernels/triton/storage.py): every program lets the next
kernel launch and waits for the one before before it loads or stores anything; no arithmetic changes.
``python -m kernels.triton.invariant_gemm`` compiles each form for sm_90 without a GPU.

Under ``TRITON_INTERPRET=1`` the tiles are cast to fp32 before ``tl.dot`` (the interpreter gets
bf16 dot wrong); on the GPU bf16 and fp16 tiles go to the tensor cores with fp32 accumulation,
and fp32 tiles are multiplied in IEEE fp32 (no TF32). The rounding to the storage dtype goes through
``_round_to_storage`` (nearest-even on every device; the interpreter's ``.to`` truncates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import compile_offline, ptx_of, require_pdl_build, run_compile_check
from kernels.triton.prep_kernel import _round_to_storage
from kernels.triton.skinny_gemm import dot_into, reduce_partials
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES, interpreted, pdl_supported


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
    # 0: one K chunk (the whole of K). n > 0: K is cut into fixed chunks, as many as bring one row
    # block's (tile, chunk) programs to n (``k_split``); never with even_k.
    split_programs: int = 0
    # Larger output tiles with the same block_k, run where their row blocks alone give them
    # ``split_programs`` programs (prefill); K keeps the cut ``k_split`` gives here.
    many_rows: GemmTiles | None = None
    # The same where K is cut (``many_rows`` when None): a program of many rows then holds two fp32
    # tiles, its chunk's and the running total, so it needs tiles half as large to stay in the
    # registers (a 128 × 256 tile's two at 8 warps spill and run 2.5-3× slower on an H100).
    many_rows_cut: GemmTiles | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise GemmShapeError(f"{name}={value}: must be a power of two of at least 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise GemmShapeError(f"num_warps={self.num_warps}: must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise GemmShapeError(f"num_stages={self.num_stages}: must be at least 1")
        if self.split_programs < 0 or (self.split_programs and self.even_k):
            raise GemmShapeError(
                f"split_programs={self.split_programs}: must be 0 (no split) or more, and 0 with even_k"
            )
        for name in ("many_rows", "many_rows_cut"):
            wide = getattr(self, name)
            if wide is not None and (
                not self.split_programs
                or wide.many_rows is not None
                or wide.many_rows_cut is not None
                or wide.split_programs
                or (wide.block_k, wide.even_k) != (self.block_k, self.even_k)
                or wide.block_m < self.block_m
                or wide.block_n < self.block_n
            ):
                raise GemmShapeError(
                    f"{name}={wide}: needs split_programs > 0 here, and tiles at least as large with"
                    f" the same block_k={self.block_k} and even_k, no split_programs and no many-rows"
                    " tiles of their own"
                )

    def k_split(self, n: int, k: int) -> tuple[int, int]:
        """(chunks, chunk width) for an [n, k] weight: K cut at fixed multiples of the width (a
        multiple of block_k), as few chunks as bring ``ceil(n / block_n) · chunks`` to
        ``split_programs``, at most one per K tile; (1, k) without a split. A function of the weight
        shape and the tiles only, never of M: that is the batch invariance."""
        k_tiles = ceil_div(k, self.block_k)
        wanted = min(k_tiles, ceil_div(self.split_programs, ceil_div(n, self.block_n)))
        if wanted <= 1:
            return 1, k
        width = ceil_div(k_tiles, wanted) * self.block_k
        return ceil_div(k, width), width

    def launch_tiles(self, m: int, n: int, k: int) -> GemmTiles:
        """The tiles an [m, k] @ [n, k].T launch runs: ``many_rows`` (``many_rows_cut`` where K is
        cut) once its row blocks alone give it ``split_programs`` programs, these tiles otherwise."""
        return self._launch_tiles(m, n, self.k_split(n, k)[0])

    def _launch_tiles(self, m: int, n: int, chunks: int) -> GemmTiles:
        """``launch_tiles`` given the K chunk count ``k_split`` gives."""
        wide = self.many_rows
        if self.many_rows_cut is not None and chunks > 1:
            wide = self.many_rows_cut
        if wide is not None and ceil_div(m, wide.block_m) * ceil_div(n, wide.block_n) >= self.split_programs:
            return wide
        return self

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
    stride_ys,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    CHUNKS_PER_PROGRAM: tl.constexpr,
    CHUNK: tl.constexpr,
    PARTIAL: tl.constexpr,
    STORAGE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        # The next kernel may launch now; x is the previous kernel's output and y may be memory it
        # still reads, so nothing is loaded or stored before the wait.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    out_ok = row_ok[:, None] & col_ok[None, :]
    # Chunks first, first + 1, …: one (grid axis 2) when the chunks meet in the reduce kernel, all
    # of them otherwise. Summed from zero in that order, as the reduce kernel sums the partials
    # (0 + -0.0 is +0.0 in both). One loop walks the program's K tiles, BLOCK_K columns at a time in
    # increasing order, into the chunk's own fp32 accumulator from zero, and adds that accumulator to
    # the total where a chunk ends: a chunk is a whole number of K tiles (or the whole of K), so no
    # tile straddles two and a K tile's mask is only K's end. One loop rather than one per chunk, so
    # the loads stay pipelined across chunk ends (docs/numerics.md, "The invariant GEMM").
    tiles_per_chunk = (CHUNK + BLOCK_K - 1) // BLOCK_K
    t_begin = tl.program_id(2) * CHUNKS_PER_PROGRAM * tiles_per_chunk
    t_end = tl.minimum(t_begin + CHUNKS_PER_PROGRAM * tiles_per_chunk, tl.cdiv(K, BLOCK_K))
    ks = t_begin * BLOCK_K + tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
    w_tile = w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_begin, t_end):
        if EVEN_K:
            a = tl.load(x_tile, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_tile, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (t - t_begin) * BLOCK_K + ks < K
            a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot_into(acc, a, b, DOT_FP32, IEEE)
        # A program of one chunk keeps no total beside the accumulator (a 128 × 256 tile's two
        # would not fit in the registers): its total is taken after the loop, as the last chunk's.
        if CHUNKS_PER_PROGRAM > 1:  # noqa: SIM102 (constexpr branch)
            if ((t + 1 - t_begin) % tiles_per_chunk == 0) & (t + 1 < t_end):
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_tile += BLOCK_K * stride_xk
        w_tile += BLOCK_K * stride_wk
    total += acc
    if PARTIAL:  # this chunk's fp32 partial, for the fixed-order reduce
        y_at = y_ptr + rows[:, None] * stride_ym + tl.program_id(2) * stride_ys + cols[None, :] * stride_yn
        tl.store(y_at, total, mask=out_ok)
    else:
        y = _round_to_storage(total, STORAGE).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, y, mask=out_ok)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


_invariant_gemm_launch = FastLaunch(_invariant_gemm_kernel)


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, tiles: GemmTiles) -> torch.Tensor:
    """``x @ weight.T`` for x [..., K] and weight [N, K], in x's dtype: one kernel launch, and the
    reduce after it when the chunks of a split K meet across programs."""
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
    chunks, width = tiles.k_split(n, k)
    launch = tiles._launch_tiles(m, n, chunks)
    row_blocks, col_blocks = ceil_div(m, launch.block_m), ceil_div(n, launch.block_n)
    # Across programs only while the row blocks alone leave the programs short of the target.
    partial = chunks > 1 and row_blocks * col_blocks < tiles.split_programs
    target = torch.empty(m, chunks, n, dtype=torch.float32, device=x.device) if partial else y
    pdl = pdl_supported(x.device)
    _invariant_gemm_launch[(row_blocks, col_blocks, chunks if partial else 1)](
        x2,
        weight,
        target,
        m,
        n,
        k,
        x2.stride(0),
        x2.stride(1),
        weight.stride(0),
        weight.stride(1),
        target.stride(0),
        target.stride(-1),
        n if partial else 0,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        EVEN_K=launch.even_k,
        CHUNKS_PER_PROGRAM=1 if partial else chunks,
        CHUNK=width,
        PARTIAL=partial,
        STORAGE=STORAGE_TYPES[x.dtype],
        DOT_FP32=interpreted(),
        IEEE=x.dtype == torch.float32,
        PDL=pdl,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    if partial:
        reduce_partials(target, y)
    return y.reshape(*lead, n)


# The many-rows tiles `invariant` runs (kernels/gemm/dispatch.py), for a whole K and a cut one: on an
# H100 the same bits as its 64 × 64 tiles, and the fastest of the tiles measured there
# (docs/benchmarks/invariance.md).
PREFILL_TILES = GemmTiles(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
PREFILL_TILES_CUT = GemmTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)

# What the compile check builds: the split across programs, within one program, and whole K (the
# invariant policy's decode forms), the many-rows tiles of a whole and of a cut K, and pin's
# unmasked whole K, at a serving shape's chunking. Each form: (partial, chunks, even_k, tiles).
COMPILE_FORMS = {
    "across": (True, 7, False, GemmTiles()),
    "within": (False, 7, False, GemmTiles()),
    "whole": (False, 1, False, GemmTiles()),
    "many-rows": (False, 1, False, PREFILL_TILES),
    "many-rows-cut": (False, 7, False, PREFILL_TILES_CUT),
    "even": (False, 1, True, GemmTiles()),
}


def compile_variant(form: str, dtype: torch.dtype, arch: int = 90) -> object:
    """The kernel compiled for ``sm_{arch}`` without a GPU in one of ``COMPILE_FORMS``, with PDL as
    it launches there."""
    partial, chunks, even_k, tiles = COMPILE_FORMS[form]
    constexprs = {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "EVEN_K": even_k,
        "CHUNKS_PER_PROGRAM": 1 if partial else chunks,
        "CHUNK": 10 * tiles.block_k,
        "PARTIAL": partial,
        "STORAGE": STORAGE_TYPES[dtype],
        "DOT_FP32": False,
        "IEEE": dtype == torch.float32,
        "PDL": arch >= 90,
        # As the runtime JIT builds it for serving tensors: unit strides along K and N are
        # specialised to 1, and N and K (multiples of 16) marked so, or the loads would not
        # vectorise or pipeline and the check would build another kernel than the one that runs.
        "stride_xk": 1,
        "stride_wk": 1,
        "stride_yn": 1,
    }
    pointer = POINTER_TYPES[dtype]

    def arg_type(name: str) -> str:
        if name == "y_ptr" and partial:
            return "*fp32"
        return pointer if name.endswith("_ptr") else "i32"

    aligned = {"x_ptr", "w_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_ys"}
    return compile_offline(
        _invariant_gemm_kernel,
        constexprs,
        arg_type,
        aligned,
        arch=arch,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        launch_pdl=arch >= 90,
    )


def main() -> int:
    for form in COMPILE_FORMS:
        for dtype in POINTER_TYPES:
            kernel = compile_variant(form, dtype)
            require_pdl_build(kernel, f"{form} {dtype}")
            # The K loop's tiles arrive through asynchronous copies, num_stages deep.
            if "cp.async" not in ptx_of(kernel):
                raise RuntimeError(f"{form} {dtype}: the K loop's loads are not pipelined")
        print(f"compiled invariant GEMM {form}")
    return 0


if __name__ == "__main__":
    run_compile_check(main)
