"""The decode GEMV family, ``y = x @ w.T`` for a few rows, with the layer's norm, residual add or
gated activation fused in (docs/kernels.md, "The fused decode GEMV").

At batch 1 a projection streams its weight once; what it loses against the copy bandwidth is what a
launch loses ramping up and draining (shared/perf-notes.md 2.1, 2.2). This kernel keeps the most
weight bytes in flight from a program's first instruction, the design perf-notes section 7 measured
at 83 % of the floor over Qwen3-4B's 144 projections (cuBLAS: 72 %):

* One program per ``rows_per_program`` output rows of the weight (``GemvSettings``), no split-K.
  Its whole weight slice ``[rows, next_pow2(K)]`` (masked past K) is ONE ``tl.load`` at the top:
  ~8192 elements, 16 KB of bf16, 64 values per thread at 4 warps, held in registers while the
  program walks its activation rows. K can instead be loaded as a power-of-two head and tail
  (``GemvSettings.k_tail``; ``gemv_settings`` takes it where that loads fewer lanes than one block).
* PDL (``launch_pdl=True``): ``gdc_launch_dependents()`` first, then the weight loads (and the norm
  weight: weights are read-only for the whole chain), then ``gdc_wait()``, and only then the
  activation, hidden and residual loads and the stores (the previous kernel writes the first and
  may still read buffers we write). Every program waits, so "the previous kernel has completed"
  stays transitive along a chain. Only on CUDA sm_90+ with a Triton that has the ops
  (``storage.pdl_supported``), never under the interpreter.
* The dot is fp32 products on the CUDA cores and one ``tl.sum`` over K per output, rounded once to
  the storage dtype at the store (``_round_to_storage``: the interpreter truncates where the GPU
  rounds). No ``tl.dot``: at one row the tensor cores would waste 15 of 16 rows.

Fused variants (constexpr flags; the spec of each is a composition in ``kernels.reference``):

* norm prologue (``reference.norm_linear``): each program loads the full hidden row, in the same
  tiles the dot reads (head and tail), sums its squares per tile, takes the inverse RMS
  (``invariant_rmsnorm._inverse_rms_of_sum``) and normalises it with the spec's rounding points
  (``prep_kernel._normalise``); the fp32 order of the sum of squares is the only freedom.
* residual epilogue (``reference.linear_residual``): ``R(residual + R(x @ w.T))``.
* gated epilogue (``reference.linear_gated``): a program owns the same rows of the gate half and the
  up half of a fused ``[2I, K]`` weight (two slices, both loaded before the wait) and stores
  ``gated_act._gated_product`` of their rounded outputs; combinable with the norm prologue.

Batch invariance by construction: the rows per program, the K tile and the reduction depend on the
weight shape only; M is not specialised and the program walks its rows one at a time through the
same code, so a row takes the same bits alone as inside any batch of up to ``MAX_ROWS``. Above
``MAX_ROWS`` the kernel refuses (the seam, ``kernels.gemm.projections``, composes instead).

``MAX_ROWS = 4``: each row costs every program a read of the whole activation row (from L1/L2: the
weight is read once, the activation once per program) and a cross-warp reduction over K (two with
the norm, three in the gated variant); at 4 rows those stay well under the time the program's
weight slice takes to arrive, and batch-1 to batch-4 decode is what the kernel is for. On an H100
the row loop, not the weight stream, sets the time past 2 rows (docs/benchmarks/qwen3.md: the plain
GEMV at batch 4 and the fused steps at batches 2 and 4).

CUDA-graph safe: a call reads tensor metadata only and allocates only its output.
``python -m kernels.triton.fused_gemv`` compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.reference import GatedActivation, NormSpec, NormWeight
from kernels.triton.gated_act import _KINDS, _gated_product
from kernels.triton.invariant_rmsnorm import _MODES, _inverse_rms_of_sum
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import (
    compile_offline,
    has_pdl_instructions,
    pointers_and_strides,
    run_compile_check,
    storage_arg_type,
)
from kernels.triton.prep_kernel import WEIGHT_NONE, _normalise, _round_to_storage
from kernels.triton.storage import (
    POINTER_TYPES,
    STORAGE_TYPES,
    interpreted,
    next_power_of_2,
    pdl_supported,
)

MAX_ROWS = 4
# A program's weight slice: the probe's rule (8192 elements, 16 KB of bf16, 64 values per thread at
# 4 warps) picks the rows; a slice is never wider than 16384 elements (one row of K ≤ 16384, or the
# skinny GEMM's register budget), past which the registers spill.
TARGET_SLICE_ELEMENTS = 8192
MAX_SLICE_ELEMENTS = 16384
# Every weight row must start 16-byte aligned at every dtype (16 fp32 values are 64 bytes).
K_ALIGN = 16


class FusedGemvError(ValueError):
    """Operands the fused GEMV cannot run; the message names the shape, tensor or value and why."""


def _is_pow2(value: int) -> bool:
    return value > 0 and not value & (value - 1)


def head_and_tail(k: int) -> tuple[int, int]:
    """K as the largest power of two ≤ K and the smallest power of two ≥ the rest (tail 0 where K
    is a power of two)."""
    if _is_pow2(k):
        return k, 0
    head = 1 << (k.bit_length() - 1)
    return head, next_power_of_2(k - head)


@dataclass(frozen=True, slots=True)
class GemvSettings:
    """Launch settings for one weight shape, never derived from M (that is the batch invariance).

    ``rows_per_program`` output rows per program (of each half, gated); ``pdl`` asks for
    programmatic dependent launch where ``pdl_supported`` allows it (no arithmetic changes).
    """

    rows_per_program: int
    num_warps: int = 4
    pdl: bool = True
    # K loaded as a power-of-two head and a power-of-two tail (``k_blocks``) instead of one masked
    # power-of-two block: at K = 9728 the one block holds 16384 lanes, 41 % of them masked.
    k_tail: bool = False

    def __post_init__(self) -> None:
        if not _is_pow2(self.rows_per_program):
            raise FusedGemvError(f"rows_per_program={self.rows_per_program}: must be a power of two")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise FusedGemvError(f"num_warps={self.num_warps}: must be 1, 2, 4, 8 or 16")

    def k_blocks(self, k: int) -> tuple[int, int]:
        """The head and tail widths a row of K is loaded in (tail 0: one block).

        One block: ``next_power_of_2(k)``, masked past K. With ``k_tail``: the largest power of two
        ≤ K, unmasked, and the smallest power of two ≥ the rest (2560 = 2048 + 512 exactly,
        9728 = 8192 + 2048 with 512 masked).
        """
        return head_and_tail(k) if self.k_tail else (next_power_of_2(k), 0)

    def slice_elements(self, k: int, *, gated: bool = False) -> int:
        """Weight elements one program loads before it waits."""
        return (2 if gated else 1) * self.rows_per_program * sum(self.k_blocks(k))

    @property
    def label(self) -> str:
        tail = "·tail" if self.k_tail else ""
        pdl = "pdl" if self.pdl else "nopdl"
        return f"r{self.rows_per_program}·w{self.num_warps}{tail}·{pdl}"

    def grid(self, n_out: int) -> int:
        """Programs for ``n_out`` output rows: one per tile. A function of the shape only, never of M."""
        return ceil_div(n_out, self.rows_per_program)


@functools.cache  # called at every eager launch; a function of the shape alone
def gemv_settings(n: int, k: int, *, gated: bool = False) -> GemvSettings:
    """The settings for an [n, k] weight (a fused [2I, k] gate/up weight when ``gated``): as many
    rows as keep the slice at ``TARGET_SLICE_ELEMENTS`` (2 rows at K = 2560 or 4096, 1 at 9728);
    K in a head and a tail where that loads fewer lanes than one block (K = 2560, 9216, 9728; not
    3840 or 15360, where both mask the same 6.25 %). On the H100 the head + tail took the down
    projection [2560, 9728] from 24.6 to 20.1 µs and every norm prologue 24-27 % off, the other
    Qwen3-4B shapes level (docs/benchmarks/gemm.md)."""
    k = max(k, 1)
    one_block = next_power_of_2(k)
    rows = max(1, TARGET_SLICE_ELEMENTS // ((2 if gated else 1) * one_block))
    return GemvSettings(rows_per_program=rows, k_tail=sum(head_and_tail(k)) < one_block)


# ---------------------------------------------------------------------------------------- kernel


@triton.jit
def _weight_slice(
    w_ptr, tile, N_OUT, K, ROWS: tl.constexpr, HEAD_K: tl.constexpr, TAIL_K: tl.constexpr, GATED: tl.constexpr
):
    """Tile ``tile``'s weight rows, K's head and tail, and the up half's same rows when gated, all
    requested at once (rows past N_OUT load nothing). Returns (w, up, w_tail, up_tail); what
    the constexprs leave out is a stand-in never read."""
    cols = tile * ROWS + tl.arange(0, ROWS)
    col_ok = cols[:, None] < N_OUT
    ks = tl.arange(0, HEAD_K)[None, :]
    row_at = cols[:, None].to(tl.int64) * K  # int64: an LM head's N·K passes 2³¹ at larger vocabularies
    up_at = (cols + N_OUT)[:, None].to(tl.int64) * K  # the up half: the same rows, I rows further on
    w = tl.load(w_ptr + row_at + ks, mask=col_ok & (ks < K), other=0.0)
    up = w
    if GATED:
        up = tl.load(w_ptr + up_at + ks, mask=col_ok & (ks < K), other=0.0)
    w_tail = w
    up_tail = w
    if TAIL_K > 0:
        ks_tail = HEAD_K + tl.arange(0, TAIL_K)[None, :]
        w_tail = tl.load(w_ptr + row_at + ks_tail, mask=col_ok & (ks_tail < K), other=0.0)
        if GATED:
            up_tail = tl.load(w_ptr + up_at + ks_tail, mask=col_ok & (ks_tail < K), other=0.0)
    return w, up, w_tail, up_tail


@triton.jit
def _tile_rows(
    x_ptr,
    res_ptr,
    out_ptr,
    tile,
    w,
    up,
    w_tail,
    up_tail,
    norm_w,
    norm_w_tail,
    M,
    N_OUT,
    K,
    stride_xm,
    stride_rm,
    stride_om,
    eps,
    ROWS: tl.constexpr,
    HEAD_K: tl.constexpr,
    TAIL_K: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    KIND: tl.constexpr,
    STORAGE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """Every activation row against one tile's weight slice: its ROWS outputs of each row stored."""
    cols = tile * ROWS + tl.arange(0, ROWS)
    ks = tl.arange(0, HEAD_K)[None, :]
    k_ok = ks < K
    for m in range(M):  # the same code for every row: a row's bits never depend on M
        x_at = x_ptr + m * stride_xm
        x = tl.load(x_at + ks, mask=k_ok, other=0.0).to(tl.float32)
        x_tail = x
        if TAIL_K > 0:
            ks_tail = HEAD_K + tl.arange(0, TAIL_K)[None, :]
            x_tail = tl.load(x_at + ks_tail, mask=ks_tail < K, other=0.0).to(tl.float32)
        if NORM:
            # The squares add in the head's and tail's own tiles: a third, whole-row tile would give
            # the compiler another layout to propagate into the dot's reduction (a 256-wide load
            # made the head's sum [1, 2] per thread, the plain kernel's [1, 1]: other fp32 bits).
            sum_squares = tl.sum(x * x, axis=1)
            if TAIL_K > 0:
                sum_squares += tl.sum(x_tail * x_tail, axis=1)
            inverse_rms = _inverse_rms_of_sum(sum_squares, K, eps)
            x = _normalise(x, inverse_rms, norm_w, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE)
        acc = tl.sum(w.to(tl.float32) * x, axis=1)
        if GATED:
            up_acc = tl.sum(up.to(tl.float32) * x, axis=1)
        if TAIL_K > 0:
            if NORM:
                x_tail = _normalise(
                    x_tail, inverse_rms, norm_w_tail, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE
                )
            acc += tl.sum(w_tail.to(tl.float32) * x_tail, axis=1)
            if GATED:
                up_acc += tl.sum(up_tail.to(tl.float32) * x_tail, axis=1)
        y = _round_to_storage(acc, STORAGE)
        if GATED:
            y = _gated_product(y, _round_to_storage(up_acc, STORAGE), KIND, STORAGE, LIBDEVICE)
        if RESIDUAL:
            res = tl.load(res_ptr + m * stride_rm + cols, mask=cols < N_OUT, other=0.0).to(tl.float32)
            y = _round_to_storage(res + y, STORAGE)  # torch's `residual + delta`: one rounding
        tl.store(out_ptr + m * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=cols < N_OUT)


# M is never specialised: one compiled kernel serves every row count (and no capture compiles).
@triton.jit(do_not_specialize=["M"])
def _fused_gemv_kernel(
    x_ptr,
    norm_w_ptr,
    w_ptr,
    res_ptr,
    out_ptr,
    M,
    N_OUT,
    K,
    stride_xm,
    stride_rm,
    stride_om,
    eps,
    ROWS: tl.constexpr,
    HEAD_K: tl.constexpr,
    TAIL_K: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    KIND: tl.constexpr,
    STORAGE: tl.constexpr,
    PDL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its own weight loads
    tile = tl.program_id(0)
    # The program's weight slice, requested before anything waits.
    w, up, w_tail, up_tail = _weight_slice(w_ptr, tile, N_OUT, K, ROWS, HEAD_K, TAIL_K, GATED)
    ks = tl.arange(0, HEAD_K)[None, :]
    norm_w = ks.to(tl.float32)  # stand-ins, unread without a norm weight
    norm_w_tail = norm_w
    if NORM and WEIGHT_MODE != WEIGHT_NONE:
        norm_w = tl.load(norm_w_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        if TAIL_K > 0:
            ks_tail = HEAD_K + tl.arange(0, TAIL_K)[None, :]
            norm_w_tail = tl.load(norm_w_ptr + ks_tail, mask=ks_tail < K, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x, residual and out belong to the previous kernel until now
    _tile_rows(
        x_ptr, res_ptr, out_ptr, tile, w, up, w_tail, up_tail, norm_w, norm_w_tail,
        M, N_OUT, K, stride_xm, stride_rm, stride_om, eps,
        ROWS, HEAD_K, TAIL_K, NORM, WEIGHT_MODE, ROUND_BEFORE_WEIGHT,
        RESIDUAL, GATED, KIND, STORAGE, LIBDEVICE,
    )  # fmt: skip


# -------------------------------------------------------------------------------------- launcher


@dataclass(frozen=True, slots=True)
class Fusion:
    """What a launch fuses around the dot: a norm prologue (``norm`` with its weight), and at most one
    epilogue (``residual`` add or gated ``activation``)."""

    norm: NormSpec | None = None
    residual: bool = False
    activation: GatedActivation | None = None

    def __post_init__(self) -> None:
        if self.residual and self.activation is not None:
            raise FusedGemvError("a fused GEMV takes one epilogue: a residual add or a gated activation")

    @property
    def name(self) -> str:
        parts = (["norm"] if self.norm else []) + ["gemv"]
        parts += ["residual"] if self.residual else []
        parts += [self.activation.value] if self.activation else []
        return "+".join(parts)


def check_fused_operands(
    x: torch.Tensor,
    weight: torch.Tensor,
    fusion: Fusion,
    *,
    kernel: str,
    tag: str,
    max_rows: int,
    error: type[ValueError],
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[str, int]:
    """What every member of the fused decode family refuses alike (its own register or shared-memory
    limit aside): raise ``error`` naming the op (``tag`` after it, if any) and shape; return that name
    and the number of output columns (N, or I for a gated [2I, K] weight)."""
    op = f"{fusion.name} ({tag})" if tag else fusion.name
    if weight.dim() != 2 or x.dim() != 2:
        raise error(f"{op}: x {tuple(x.shape)}, weight {tuple(weight.shape)}: takes x [M, K] and w [N, K]")
    (m, k), n = x.shape, weight.shape[0]
    name = f"{op} x [{m}, {k}] @ w [{n}, {weight.shape[1]}].T {str(x.dtype).removeprefix('torch.')}"
    if weight.shape[1] != k:
        raise error(f"{name}: x has K={k}, the weight K={weight.shape[1]}")
    if m > max_rows:
        raise error(f"{name}: M={m} rows, the fused {kernel} takes at most {max_rows}")
    if x.dtype != weight.dtype or x.dtype not in STORAGE_TYPES:
        raise error(f"{name}: dtypes x={x.dtype}, weight={weight.dtype} must match and be bf16, fp16 or fp32")
    if x.device != weight.device:
        raise error(f"{name}: devices x={x.device}, weight={weight.device} must match")
    if x.device.type != "cuda" and not interpreted():
        raise error(f"{name}: device {x.device}; the Triton kernel needs CUDA (or TRITON_INTERPRET=1)")
    if k < 1 or k % K_ALIGN:
        raise error(
            f"{name}: K={k} is not a positive multiple of {K_ALIGN} (weight rows stay 16-byte aligned)"
        )
    if x.stride(1) != 1:
        raise error(f"{name}: x's last dim has stride {x.stride(1)}; it must be contiguous")
    if not weight.is_contiguous():
        raise error(f"{name}: the weight must be contiguous (strides {weight.stride()})")
    gated = fusion.activation is not None
    if gated and n % 2:
        raise error(f"{name}: a gated weight has gate and up halves; N={n} is odd")
    n_out = n // 2 if gated else n
    if fusion.norm is not None:
        if (norm_weight is None) != (fusion.norm.weight is NormWeight.NONE):
            raise error(
                f"{name}: norm weight {fusion.norm.weight.value!r} was given "
                f"norm_weight={None if norm_weight is None else 'tensor'}"
            )
        if norm_weight is not None and (
            tuple(norm_weight.shape) != (k,) or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1
        ):
            raise error(
                f"{name}: norm_weight is {tuple(norm_weight.shape)} {norm_weight.dtype} "
                f"(stride {norm_weight.stride()}), not a contiguous [{k}] {x.dtype}"
            )
    elif norm_weight is not None:
        raise error(f"{name}: norm_weight was given without a norm spec")
    if fusion.residual != (residual is not None):
        raise error(f"{name}: residual={'tensor' if residual is not None else None} for {fusion.name}")
    for label, t in (("residual", residual), ("out", out)):
        if t is None:
            continue
        if tuple(t.shape) != (m, n_out) or t.dtype != x.dtype or t.device != x.device:
            raise error(
                f"{name}: {label} is {tuple(t.shape)} {t.dtype} on {t.device}, not {[m, n_out]} "
                f"{x.dtype} on {x.device}"
            )
        if t.stride(1) != 1:
            raise error(f"{name}: {label}'s last dim has stride {t.stride(1)}; it must be contiguous")
    return name, n_out


def check_fused_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    fusion: Fusion,
    settings: GemvSettings,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> int:
    """Raise ``FusedGemvError`` naming the shape for anything ``fused_gemv`` cannot run; returns the
    number of output columns (N, or I for a gated [2I, K] weight)."""
    name, n_out = check_fused_operands(
        x,
        weight,
        fusion,
        kernel="GEMV",
        tag="",
        max_rows=MAX_ROWS,
        error=FusedGemvError,
        norm_weight=norm_weight,
        residual=residual,
        out=out,
    )
    elements = settings.slice_elements(x.shape[1], gated=fusion.activation is not None)
    if elements > MAX_SLICE_ELEMENTS:
        raise FusedGemvError(
            f"{name}: settings {settings.label}: a program's weight slice holds {elements} elements, "
            f"over the {MAX_SLICE_ELEMENTS} it keeps in registers"
        )
    return n_out


_fused_gemv_launch = FastLaunch(_fused_gemv_kernel)


def fused_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    fusion: Fusion = Fusion(),
    settings: GemvSettings | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch of the fused GEMV for x [M ≤ MAX_ROWS, K] (any row stride) and a contiguous weight.

    Plain: ``reference.linear(x, weight)``. ``fusion.norm`` (with ``norm_weight``): x is the hidden
    row and ``reference.norm_linear`` is computed. ``fusion.residual`` (with ``residual [M, N]``):
    ``reference.linear_residual``. ``fusion.activation``: weight is a fused ``[2I, K]`` gate/up and
    the result ``reference.linear_gated``, ``[M, I]``. ``settings`` default to ``gemv_settings`` of
    the weight shape. ``out`` (any row stride) receives the result; only its M rows are written.
    Raises ``FusedGemvError`` for anything it cannot run (``check_fused_gemv``).
    """
    gated = fusion.activation is not None
    chosen = settings or gemv_settings(weight.shape[0] // (2 if gated else 1), weight.shape[-1], gated=gated)
    n_out = check_fused_gemv(x, weight, fusion, chosen, norm_weight=norm_weight, residual=residual, out=out)
    m, k = x.shape
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    pdl = chosen.pdl and pdl_supported(x.device)
    # No FMA contraction: the products and their sum are separately rounded fp32, as in the spec.
    launch: dict[str, object] = {"num_warps": chosen.num_warps, "num_stages": 1, "enable_fp_fusion": False}
    if pdl:
        launch["launch_pdl"] = True
    spec = fusion.norm
    head_k, tail_k = chosen.k_blocks(k)
    _fused_gemv_launch[(chosen.grid(n_out),)](
        x,
        x if norm_weight is None else norm_weight,  # unread without a norm weight
        weight,
        y if residual is None else residual,  # unread without RESIDUAL
        y,
        m,
        n_out,
        k,
        x.stride(0),
        y.stride(0) if residual is None else residual.stride(0),
        y.stride(0),
        spec.eps if spec is not None else 0.0,
        ROWS=chosen.rows_per_program,
        HEAD_K=head_k,
        TAIL_K=tail_k,
        NORM=spec is not None,
        WEIGHT_MODE=_MODES[spec.weight if spec is not None else NormWeight.NONE],
        ROUND_BEFORE_WEIGHT=spec.round_before_weight if spec is not None else False,
        RESIDUAL=fusion.residual,
        GATED=gated,
        KIND=_KINDS[fusion.activation or GatedActivation.SILU],
        STORAGE=STORAGE_TYPES[x.dtype],
        PDL=pdl,
        LIBDEVICE=not interpreted(),
        **launch,
    )
    return y


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)

QWEN3 = NormSpec(NormWeight.W, eps=1e-6, round_before_weight=True)
QWEN35 = NormSpec(NormWeight.ONE_PLUS_W, eps=1e-6)
# Every fusion a model line uses ([N, K]; the gated weight is the fused [2I, K]): Qwen3-4B's serving
# shapes; Qwen3.5-4B's norm + in_proj and norm + gate/up (`1 + w`, one rounding); Gemma 4 12B's plain
# QKV and LM head (K = 3840), global O (K = 8192), down (K = 15360, the largest K a program takes in
# one row) and gate/up with GELU-tanh.
COMPILE_VARIANTS: tuple[tuple[Fusion, int, int], ...] = (
    (Fusion(), 151936, 2560),
    (Fusion(norm=QWEN3), 6144, 2560),
    (Fusion(residual=True), 2560, 4096),
    (Fusion(norm=QWEN3, activation=GatedActivation.SILU), 19456, 2560),
    (Fusion(residual=True), 2560, 9728),
    (Fusion(norm=QWEN35), 12352, 2560),
    (Fusion(norm=QWEN35, activation=GatedActivation.SILU), 18432, 2560),
    (Fusion(), 262144, 3840),
    (Fusion(), 3840, 8192),
    (Fusion(), 3840, 15360),
    (Fusion(activation=GatedActivation.GELU_TANH), 30720, 3840),
)


# The k_tail builds the compile check makes of every variant: K in one block, and in a head and tail.
LAYOUTS = (False, True)


def compile_variant(
    fusion: Fusion,
    n: int,
    k: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    arch: int = 90,
    k_tail: bool = False,
) -> object:
    """The compiled kernel (cubin and PTX) for one variant, PDL on, on ``sm_{arch}``, without a GPU:
    the shape's default settings, K in a head and a tail when ``k_tail``."""
    gated = fusion.activation is not None
    default = gemv_settings(n // 2 if gated else n, k, gated=gated)
    settings = replace(default, k_tail=k_tail)
    head_k, tail_k = settings.k_blocks(k)
    spec = fusion.norm
    constexprs = {
        "ROWS": settings.rows_per_program,
        "HEAD_K": head_k,
        "TAIL_K": tail_k,
        "NORM": spec is not None,
        "WEIGHT_MODE": _MODES[spec.weight if spec is not None else NormWeight.NONE].value,
        "ROUND_BEFORE_WEIGHT": spec.round_before_weight if spec is not None else False,
        "RESIDUAL": fusion.residual,
        "GATED": gated,
        "KIND": _KINDS[fusion.activation or GatedActivation.SILU].value,
        "STORAGE": STORAGE_TYPES[dtype],
        "PDL": True,
        "LIBDEVICE": True,
    }
    # As the runtime JIT specialises at serving shapes: 16-aligned pointers, K and row strides.
    return compile_offline(
        _fused_gemv_kernel,
        constexprs,
        storage_arg_type(dtype),
        pointers_and_strides(_fused_gemv_kernel) | {"K"},
        arch=arch,
        num_warps=settings.num_warps,
        launch_pdl=True,
        enable_fp_fusion=False,
    )


def main() -> int:
    failures = []
    for fusion, n, k in COMPILE_VARIANTS:
        for dtype, k_tail in itertools.product(POINTER_TYPES, LAYOUTS):
            kernel = compile_variant(fusion, n, k, dtype, k_tail=k_tail)
            asm = getattr(kernel, "asm", {})
            ptx = str(asm.get("ptx", ""))
            problems = [] if asm.get("cubin") else ["no cubin"]
            if not has_pdl_instructions(ptx):
                problems.append("no griddepcontrol instructions")
            if not any("ld.global" in line and ".v4." in line for line in ptx.splitlines()):
                problems.append("no 128-bit global loads")
            if problems:
                layout = f" (K head + tail: {k_tail})"
                failures.append(f"{fusion.name} [{n}, {k}]{layout} {dtype}: {', '.join(problems)}")
        print(f"compiled {fusion.name} [{n}, {k}]")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    run_compile_check(main)
