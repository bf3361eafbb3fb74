"""The skinny GEMM for decode, ``y = x @ w.T`` with x [M ≤ 64, K]: a weight-streaming kernel.

At decode a projection reads its whole weight once for a handful of activation rows, so its time is
the weight bytes over the memory bandwidth plus what each launch loses ramping up and draining
(docs/kernels.md, "The skinny GEMM"; shared/perf-notes.md 2.1, 2.2). The kernel is built to
keep weight bytes in flight from its first instruction to its last:

* Grid ``(row blocks, N blocks, K splits)``. A program owns ``block_n`` output columns of
  ``block_m`` rows (16: an mma.sync row block) over one K split, and does one ``tl.dot`` per K tile
  with fp32 accumulation. Weight rows are contiguous, every row starts 16-byte aligned (K is a
  multiple of 16), so the weight loads are 16-byte vectors (``ld.global.v4`` / ``cp.async`` 16 B,
  checked in the PTX by ``kernels.triton.skinny_aot``).
* Whole-slice mode (``block_k=None``): a program's entire weight slice, ``block_n × (its K
  split)`` elements, is one ``tl.load`` issued at the top. The bytes-in-flight argument, at the
  default [16, 512] bf16 slice: the sm_90 build takes 118 registers, so 4 programs fit an SM
  (65536 / (120 · 128 threads)), each with 16 KB requested before it waits: 64 KB per SM, 8.4 MB
  over 132 SMs. Streaming HBM at ~4.3 TB/s with ~1 µs of latency needs ~4.3 MB in flight, about
  32 KB per SM; the probe that loaded whole slices this way reached 80-83 % of the copy bandwidth
  where a K loop without them reached 74 % (perf-notes section 7).
* K-loop mode (``block_k`` set): the split is walked ``block_k`` columns at a time and Triton's
  software pipeline keeps ``num_stages - 1`` tiles per program in flight through shared memory;
  cheaper in registers, but its loads start after ``gdc_wait``.
* PDL (``pdl=True``, launched with ``launch_pdl=True``): ``gdc_launch_dependents()`` first, so the
  next kernel can start its own weight loads while this one runs; ``gdc_wait()`` after the weight
  loads and before the first activation load or store. Weights are read-only for the whole chain,
  so loading them early is safe; x (the previous kernel's output) and our outputs (which the
  previous kernel may still be reading, in a reused buffer) are touched only after the wait. Every
  program of every PDL launch waits, so "the previous kernel has completed" stays transitive along
  a chain. Used only on CUDA, compute capability 9.0 or newer, with a Triton that has the ``gdc_*``
  ops and the ``launch_pdl`` option; never under the interpreter (``pdl_supported``).
* Split-K (``split_k > 1``): each split writes its fp32 partial sums to a scratch buffer
  ``[M, split_k, N]``; a second small kernel (PDL too) adds them in the fixed order 0, 1, …,
  split_k − 1 and rounds once. No atomics, so two runs are bit-identical.

Batch invariance by construction: the K partition (tile width, tiles per split, number of splits),
the row-block size and the instruction selection depend on the weight shape and the settings only,
never on M; M is not even specialised by Triton. Every output element is reduced over the same K
tiles in the same order into one fp32 accumulator, and rows never mix, so a row gets the same bits
alone as inside a batch of 64. The settings are a frozen dataclass chosen per weight shape
(``kernels.gemm.skinny_dispatch`` carries them).

CUDA-graph safe: a call reads only tensor metadata on the host, never synchronises, and allocates
only its output (unless ``out=`` is given) and the split-K scratch, from the caching allocator.

Under ``TRITON_INTERPRET=1`` the tiles are cast to fp32 before ``tl.dot`` (the interpreter gets
bf16 dot wrong); on the GPU bf16/fp16 tiles go to the tensor cores with fp32 accumulation and fp32
tiles are multiplied in IEEE fp32 (no TF32). The one rounding to the storage dtype goes through
the prep kernel's ``_round_to_storage`` (integer ops, nearest-even), not ``.to()``: the interpreter
truncates fp32 → bf16 where the GPU rounds to nearest-even, and both must compute the spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.triton.launch import FastLaunch
from kernels.triton.prep_kernel import _round_to_storage
from kernels.triton.storage import STORAGE_TYPES, interpreted, next_power_of_2, pdl_supported

MAX_ROWS = 64
# Elements of one program's weight tile: 16384 bf16 values are 32 KB, 64 registers per thread at
# 4 warps before the dot operands (a [16, 1024] tile builds at 186 registers with 8 warps, one
# program per SM). A larger tile would spill.
MAX_TILE_ELEMENTS = 16384
# K must keep every weight row 16-byte aligned at every dtype (16 fp32 values are 64 bytes).
K_ALIGN = 16
# Columns per reduce program: N = 2560 at M = 1 still spreads over 10 programs.
REDUCE_BLOCK = 256


class SkinnyShapeError(ValueError):
    """A GEMM this kernel (or these settings) cannot run; the message names the shape and why."""


def _is_pow2(value: int) -> bool:
    return value > 0 and not value & (value - 1)


@dataclass(frozen=True, slots=True)
class KPartition:
    """How one weight shape's K axis is cut: tiles of ``block_k``, ``tiles_per_split`` per split.

    Split ``s`` covers columns ``[s · tiles_per_split · block_k, (s + 1) · tiles_per_split · block_k)``
    clipped to K (the loads are masked past K). A function of K and the settings only: this is what
    makes the kernel batch-invariant.
    """

    block_k: int
    tiles_per_split: int
    split_k: int

    def exact(self, k: int) -> bool:
        """Whether the tiles end exactly at K (no masked tail)."""
        return self.split_k * self.tiles_per_split * self.block_k == k


@dataclass(frozen=True, slots=True)
class SkinnySettings:
    """Launch settings of the skinny GEMM, fixed per weight shape and never derived from M.

    ``block_k=None`` is whole-slice mode: each split's K range is one tile, ``next_pow2(⌈K / split_k⌉)``
    wide, loaded with one ``tl.load`` before ``gdc_wait``. ``num_stages`` only matters in K-loop mode.
    ``pdl`` asks for programmatic dependent launch; it is used where ``pdl_supported`` says so and
    changes no arithmetic.
    """

    block_n: int = 16
    block_k: int | None = None
    split_k: int = 1
    block_m: int = 16
    num_warps: int = 4
    num_stages: int = 1
    pdl: bool = True

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or not _is_pow2(value):
                raise SkinnyShapeError(f"{name}={value}: must be a power of two of at least 16")
        if self.block_k is not None and (self.block_k < 16 or not _is_pow2(self.block_k)):
            raise SkinnyShapeError(
                f"block_k={self.block_k}: must be None (whole slice) or a power of two ≥ 16"
            )
        if self.split_k < 1:
            raise SkinnyShapeError(f"split_k={self.split_k}: must be at least 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise SkinnyShapeError(f"num_warps={self.num_warps}: must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise SkinnyShapeError(f"num_stages={self.num_stages}: must be at least 1")

    @property
    def whole_slice(self) -> bool:
        return self.block_k is None

    def partition(self, k: int) -> KPartition:
        """The K partition for a weight with ``k`` columns (no checks; see ``problem``)."""
        if self.block_k is None:
            block_k = next_power_of_2(ceil_div(k, self.split_k))
            tiles = 1
        else:
            block_k = self.block_k
            tiles = ceil_div(ceil_div(k, block_k), self.split_k)
        return KPartition(block_k, tiles, self.split_k)

    def problem(self, n: int, k: int) -> str | None:
        """Why these settings cannot run an [n, k] weight; None when they can."""
        if n < 1 or k < 1:
            return "N and K must be positive"
        if k % K_ALIGN:
            return f"K={k} is not a multiple of {K_ALIGN} (weight rows must stay 16-byte aligned)"
        part = self.partition(k)
        tile = self.block_n * part.block_k
        if tile > MAX_TILE_ELEMENTS:
            return (
                f"a program's weight tile [{self.block_n}, {part.block_k}] holds {tile} elements, "
                f"over the {MAX_TILE_ELEMENTS} a program keeps in registers"
            )
        if (part.split_k - 1) * part.tiles_per_split * part.block_k >= k:
            return f"K={k} leaves the last of split_k={self.split_k} splits empty (tile {part.block_k})"
        return None

    @property
    def label(self) -> str:
        """Short name for tables: ``n16·whole·s5·m16·w4·pdl``, ``n32·k256x4·s3·m16·w4·pdl``."""
        k = "whole" if self.block_k is None else f"k{self.block_k}x{self.num_stages}"
        pdl = "pdl" if self.pdl else "nopdl"
        return f"n{self.block_n}·{k}·s{self.split_k}·m{self.block_m}·w{self.num_warps}·{pdl}"

    def to_json(self) -> dict[str, int | bool | None]:
        return {
            "block_n": self.block_n,
            "block_k": self.block_k,
            "split_k": self.split_k,
            "block_m": self.block_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "pdl": self.pdl,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> SkinnySettings:
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise SkinnyShapeError(f"skinny settings {dict(data)}: unknown field(s) {unknown}")
        block_k = data.get("block_k")
        return cls(
            block_n=json_int(data, "block_n", 16),
            block_k=None if block_k is None else json_int(data, "block_k", 0),
            split_k=json_int(data, "split_k", 1),
            block_m=json_int(data, "block_m", 16),
            num_warps=json_int(data, "num_warps", 4),
            num_stages=json_int(data, "num_stages", 1),
            pdl=bool(data.get("pdl", True)),
        )


def json_int(data: Mapping[str, object], key: str, default: int) -> int:
    """``data[key]`` (or ``default``) as an int; anything else is refused naming the key."""
    value = data.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SkinnyShapeError(f"{key}={value!r}: must be an integer")
    return value


# ---------------------------------------------------------------------------------------- kernels


@triton.jit
def dot_into(acc, a, b, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @ b`` in fp32 for tiles a [rows, k] and b [k, cols]: the tensor cores for bf16 and
    fp16, IEEE fp32 products for fp32 (no TF32). The invariant GEMM's K step too."""
    if DOT_FP32:  # the interpreter's bf16 dot is wrong; fp32 products of bf16/fp16 are exact anyway
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:  # noqa: SIM108 (constexpr branch; each arm is its own tl.dot form)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _accumulate(acc, a, w, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a @ w.T`` for an activation tile a [rows, k] and a weight tile w [cols, k], in fp32."""
    return dot_into(acc, a, tl.trans(w), DOT_FP32, IEEE)


# M is never specialised: one compiled kernel serves every row count (and no capture compiles).
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    WHOLE: tl.constexpr,
    STORAGE: tl.constexpr,
    PDL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its own weight loads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_s * (K_TILES * BLOCK_K) + tl.arange(0, BLOCK_K)  # this split's first tile
    row_ok = rows < M
    col_ok = cols < N
    # Weight offsets in int64: an LM head's N·K passes 2³¹ at larger vocabularies.
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
    x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WHOLE:
        # The program's whole weight slice, requested before anything that waits.
        w = tl.load(w_tile, mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()  # x is the previous kernel's output: only now may we read it
        a = tl.load(x_tile, mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        acc = _accumulate(acc, a, w, DOT_FP32, IEEE)
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        for t in range(K_TILES):  # the split's tiles in one fixed order, pipelined by Triton
            k_ok = (ks + t * BLOCK_K) < K
            w = tl.load(w_tile + t * BLOCK_K, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(x_tile + t * BLOCK_K, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _accumulate(acc, a, w, DOT_FP32, IEEE)
    # out is y [M, N] (split_k = 1; STORAGE its dtype) or this split's slice of the fp32 scratch
    # [M, split_k, N] (STORAGE fp32: no rounding). The one rounding is nearest-even on every device.
    out = out_ptr + pid_s * stride_os + rows[:, None] * stride_om + cols[None, :]
    y = _round_to_storage(acc, STORAGE).to(out_ptr.dtype.element_ty)
    tl.store(out, y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(
    partial_ptr,
    y_ptr,
    M,
    N,
    stride_ym,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    STORAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the partials are the GEMM kernel's output
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order 0, 1, …, SPLIT_K - 1: deterministic
        acc += tl.load(partial_ptr + (row * SPLIT_K + s) * N + cols, mask=ok, other=0.0)
    tl.store(
        y_ptr + row * stride_ym + cols, _round_to_storage(acc, STORAGE).to(y_ptr.dtype.element_ty), mask=ok
    )


# ---------------------------------------------------------------------------------------- launcher


def shape_name(m: int, n: int, k: int, dtype: torch.dtype) -> str:
    return f"x [{m}, {k}] @ w [{n}, {k}].T {str(dtype).removeprefix('torch.')}"


def check_skinny(
    x: torch.Tensor, weight: torch.Tensor, settings: SkinnySettings, out: torch.Tensor | None = None
) -> None:
    """Raise ``SkinnyShapeError`` naming the shape if ``skinny_gemm`` cannot run these operands."""
    if weight.dim() != 2 or x.dim() != 2:
        raise SkinnyShapeError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: the skinny GEMM takes x [M, K] and w [N, K]"
        )
    (m, k), n = x.shape, weight.shape[0]
    name = shape_name(m, n, weight.shape[1], x.dtype)
    if weight.shape[1] != k:
        raise SkinnyShapeError(f"{name}: x has K={k}, the weight K={weight.shape[1]}")
    if m > MAX_ROWS:
        raise SkinnyShapeError(f"{name}: M={m} rows, the skinny GEMM takes at most {MAX_ROWS}")
    if x.dtype != weight.dtype or x.dtype not in STORAGE_TYPES:
        raise SkinnyShapeError(
            f"{name}: dtypes x={x.dtype}, weight={weight.dtype} must match and be bf16, fp16 or fp32"
        )
    if x.device != weight.device:
        raise SkinnyShapeError(f"{name}: devices x={x.device}, weight={weight.device} must match")
    if x.device.type != "cuda" and not interpreted():
        raise SkinnyShapeError(
            f"{name}: device {x.device}; the Triton kernel needs CUDA (or TRITON_INTERPRET=1)"
        )
    if x.stride(1) != 1:
        raise SkinnyShapeError(f"{name}: x's last dim has stride {x.stride(1)}; it must be contiguous")
    if not weight.is_contiguous():
        raise SkinnyShapeError(f"{name}: the weight must be contiguous (strides {weight.stride()})")
    if out is not None:
        if tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.device != x.device:
            raise SkinnyShapeError(
                f"{name}: out is {tuple(out.shape)} {out.dtype} on {out.device}, not [{m}, {n}] {x.dtype}"
            )
        if out.stride(1) != 1:
            raise SkinnyShapeError(
                f"{name}: out's last dim has stride {out.stride(1)}; it must be contiguous"
            )
    why = settings.problem(n, k)
    if why is not None:
        raise SkinnyShapeError(f"{name}: settings {settings.label}: {why}")


_skinny_gemm_launch = FastLaunch(_skinny_gemm_kernel)
_split_k_reduce_launch = FastLaunch(_split_k_reduce_kernel)


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, settings: SkinnySettings, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for x [M ≤ 64, K] (any row stride) and a contiguous weight [N, K], in x's dtype.

    ``out`` (optional, [M, N], any row stride) receives the result; only its M × N elements are
    written. One launch, plus the fixed-order reduce when ``settings.split_k > 1``. Raises
    ``SkinnyShapeError`` for anything it cannot run (``check_skinny``);
    ``kernels.gemm.skinny_dispatch`` falls back to ``F.linear`` by name.
    """
    check_skinny(x, weight, settings, out)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    part = settings.partition(k)
    pdl = settings.pdl and pdl_supported(x.device)
    # No FMA contraction outside tl.dot (the one rounding after the sum is the only other op).
    launch: dict[str, object] = {
        "num_warps": settings.num_warps,
        "num_stages": settings.num_stages,
        "enable_fp_fusion": False,
    }
    if pdl:
        launch["launch_pdl"] = True
    split = part.split_k > 1
    # Scratch [M, split_k, N]: its strides (split_k·N per row, N per split) do not depend on M, so
    # Triton specialises the kernel the same way at every row count.
    target = torch.empty(m, part.split_k, n, dtype=torch.float32, device=x.device) if split else y
    grid = (ceil_div(m, settings.block_m), ceil_div(n, settings.block_n), part.split_k)
    _skinny_gemm_launch[grid](
        x,
        weight,
        target,
        m,
        n,
        k,
        x.stride(0),
        part.split_k * n if split else y.stride(0),
        n if split else 0,
        BLOCK_M=settings.block_m,
        BLOCK_N=settings.block_n,
        BLOCK_K=part.block_k,
        K_TILES=part.tiles_per_split,
        WHOLE=settings.whole_slice,
        STORAGE=tl.float32 if split else STORAGE_TYPES[x.dtype],
        PDL=pdl,
        DOT_FP32=interpreted(),
        IEEE=x.dtype == torch.float32,
        **launch,
    )
    if split:
        reduce_partials(target, y, pdl=pdl)
    return y


def reduce_partials(partials: torch.Tensor, y: torch.Tensor, *, pdl: bool | None = None) -> None:
    """``y[m, n]`` = the fp32 ``partials[m, 0, n] + partials[m, 1, n] + …``, added in that order from
    zero and rounded once to ``y``'s dtype: the split-K reduce (the invariant GEMM's too). ``partials``
    is a contiguous [M, splits, N]; ``y`` any row stride. PDL where ``pdl_supported`` (``pdl=None``)."""
    m, splits, n = partials.shape
    if pdl is None:
        pdl = pdl_supported(y.device)
    launch: dict[str, object] = {"num_warps": 4, "enable_fp_fusion": False}
    if pdl:
        launch["launch_pdl"] = True
    _split_k_reduce_launch[(m, ceil_div(n, REDUCE_BLOCK))](
        partials,
        y,
        m,
        n,
        y.stride(0),
        SPLIT_K=splits,
        BLOCK=REDUCE_BLOCK,
        STORAGE=STORAGE_TYPES[y.dtype],
        PDL=pdl,
        **launch,
    )
