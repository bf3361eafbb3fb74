"""The decode GEMM family on tensor cores, ``y = x @ w.T`` for 4 < M ≤ 64 rows, with the layer's norm,
residual add or gated activation fused in (docs/kernels.md, "The fused decode MMA").

The fused GEMV (``fused_gemv``) covers M ≤ 4 on the CUDA cores; above that its per-row activation
re-reads and reductions stop being free. This kernel computes the same ops (``Fusion``; the specs are
``reference.norm_linear`` / ``linear_residual`` / ``linear_gated``) with ``tl.dot``:

* One program per ``block_n`` output columns (of each half, gated) and ALL the step's rows in one row
  block, so every weight byte is read once per step (the skinny GEMM's 16-row blocks re-read the
  weight four times at M = 64: docs/benchmarks/gemm.md). No split-K: an epilogue needs the whole sum.
* The row block is 16 rows for M ≤ 16 and 64 above (``row_block``): at batch 8 a 64-row block would
  carry 56 zero rows through shared memory and the MMAs of every K tile, at batch 64 the 16-row
  block is the re-read above. Within one row-block size nothing depends on M.
* K walked in ``block_k`` tiles in one fixed order, one fp32 accumulator per output (two gated),
  Triton's software pipeline keeping ``num_stages - 1`` tiles in flight. The settings
  (``MmaSettings``) come from the weight shape and the row-block size only (``mma_settings``).
* Norm prologue: a first pass over the row block's hidden rows (from L2: the previous kernel just
  wrote them) sums their squares tile by tile into ``_inverse_rms_of_sum``; then each K tile of the
  hidden rows is normalised with the spec's rounding points (``_normalise``) before its dot. The fp32
  order of the sum of squares (the K tiles') is the only freedom it takes, as in the GEMV.
* Epilogues as in the GEMV: the one rounding of the dot through ``_round_to_storage`` (the
  interpreter truncates ``.to()`` where the GPU rounds), ``R(residual + y)``, or ``_gated_product``
  of the two rounded halves.
* PDL (``storage`` module doc): ``gdc_launch_dependents()`` first; the program's first weight tile
  (both halves, gated) is requested before ``gdc_wait()``; the hidden rows, the residual and every
  store come after it.
* Under the interpreter the tiles go to ``tl.dot`` in fp32 (``skinny_gemm._accumulate``); fp32
  operands are multiplied in IEEE fp32 on the GPU (no TF32).

Batch invariance by construction within a row-block size: the K tiles, their order, the row-block
shape and the instruction selection depend on the weight shape and the settings only, M is not
specialised, and the rows of a dot never mix, so a row gets the same bits alone as inside any batch
of the same row block (1-16 or 17-64 rows). Across the 16/17 boundary, and against the GEMV at
M ≤ 4, the bits may differ (the ``tuned`` policy does not promise otherwise).

CUDA-graph safe: a call reads tensor metadata only and allocates only its output.
``python -m kernels.triton.fused_mma`` compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.reference import GatedActivation, NormWeight
from kernels.triton.fused_gemv import QWEN3, Fusion, check_fused_operands
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
from kernels.triton.skinny_gemm import _accumulate
from kernels.triton.storage import STORAGE_TYPES, interpreted, pdl_supported

MAX_ROWS = 64
# The row-block sizes: tl.dot tiles are at least 16 rows; 64 holds every step the kernel takes.
ROW_BLOCKS = (16, 64)
# Shared memory one program's pipeline may hold (the H200 gives a block up to 227 KB).
MAX_PIPELINE_BYTES = 200 * 1024
# Enough programs to cover the H200's 132 SMs about once: block_n shrinks until the grid reaches it.
TARGET_PROGRAMS = 128


class FusedMmaError(ValueError):
    """Operands the fused MMA cannot run; the message names the shape, tensor or value and why."""


def _is_pow2(value: int) -> bool:
    return value > 0 and not value & (value - 1)


def row_block(m: int) -> int:
    """The row block a step of ``m`` rows runs in (module doc): 16 up to 16 rows, 64 above."""
    return ROW_BLOCKS[0] if m <= ROW_BLOCKS[0] else ROW_BLOCKS[1]


@dataclass(frozen=True, slots=True)
class MmaSettings:
    """Launch settings for one weight shape and row-block size, never derived from M.

    ``block_n`` output columns per program (of each half, gated), K in ``block_k`` tiles with
    ``num_stages`` in the pipeline; ``pdl`` asks for programmatic dependent launch where
    ``pdl_supported`` allows it (no arithmetic changes).
    """

    block_n: int = 32
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4
    pdl: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or not _is_pow2(value):
                raise FusedMmaError(f"{name}={value}: must be a power of two of at least 16")
        if self.num_stages < 1:
            raise FusedMmaError(f"num_stages={self.num_stages}: must be at least 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise FusedMmaError(f"num_warps={self.num_warps}: must be 1, 2, 4, 8 or 16")

    def pipeline_bytes(self, block_m: int, element: int, *, gated: bool = False) -> int:
        """Shared memory the pipeline holds: ``num_stages`` tiles of the rows and the weight."""
        rows = block_m + (2 if gated else 1) * self.block_n
        return self.num_stages * rows * self.block_k * element

    @property
    def label(self) -> str:
        """Short name for tables: ``n32·k128x4·w4·pdl``."""
        pdl = "pdl" if self.pdl else "nopdl"
        return f"n{self.block_n}·k{self.block_k}x{self.num_stages}·w{self.num_warps}·{pdl}"

    @classmethod
    def from_label(cls, label: str) -> MmaSettings:
        """``label``'s inverse (a saved ``infer bench gemm`` result names the kept settings so)."""
        found = _LABEL.fullmatch(label)
        if found is None:
            raise FusedMmaError(f"{label!r} is not an MMA settings label like 'n32·k128x4·w4·pdl'")
        block_n, block_k, stages, warps, pdl = found.groups()
        return cls(int(block_n), int(block_k), int(stages), int(warps), pdl == "pdl")

    def to_json(self) -> dict[str, int | bool]:
        return {name: getattr(self, name) for name in _JSON_FIELDS}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> MmaSettings:
        """``to_json``'s inverse: every field present, integers and a bool, else refused naming it."""
        if set(data) != set(_JSON_FIELDS):
            raise FusedMmaError(f"MMA settings {dict(data)}: the fields must be {', '.join(_JSON_FIELDS)}")
        ints: dict[str, int] = {}
        for name in _JSON_FIELDS[:-1]:
            value = data[name]
            if not isinstance(value, int) or isinstance(value, bool):
                raise FusedMmaError(f"MMA settings {dict(data)}: {name}={value!r} must be an integer")
            ints[name] = value
        pdl = data["pdl"]
        if not isinstance(pdl, bool):
            raise FusedMmaError(f"MMA settings {dict(data)}: pdl={pdl!r} must be true or false")
        return cls(**ints, pdl=pdl)


_LABEL = re.compile(r"n(\d+)·k(\d+)x(\d+)·w(\d+)·(pdl|nopdl)")
_JSON_FIELDS = tuple(field.name for field in fields(MmaSettings))  # pdl last: the one bool


def mma_settings(n: int, k: int, block_m: int, *, gated: bool = False, element: int = 2) -> MmaSettings:
    """The settings for an [n, k] weight (n output columns: I for a fused [2I, k] gate/up weight) of
    ``element``-byte values in a ``block_m`` row block: 256-wide K tiles with 16 rows (the skinny
    GEMM's measured winner was [32, 256] × 4 stages), 128-wide with 64 (the rows' tile grows
    fourfold); ``block_n`` the widest of 64, 32, 16 (32 gated: two weight tiles per stage) that still
    gives ``TARGET_PROGRAMS``; 4 stages, fewer where they would pass ``MAX_PIPELINE_BYTES`` (fp32)."""
    widths = (32, 16) if gated else (64, 32, 16)
    block_n = next((w for w in widths if ceil_div(n, w) >= TARGET_PROGRAMS), 16)
    block_k = 256 if block_m <= ROW_BLOCKS[0] else 128
    stage = MmaSettings(block_n=block_n, block_k=block_k, num_stages=1).pipeline_bytes(
        block_m, element, gated=gated
    )
    return MmaSettings(
        block_n=block_n, block_k=block_k, num_stages=max(1, min(4, MAX_PIPELINE_BYTES // stage))
    )


def mma_candidates(
    n: int, k: int, block_m: int, *, gated: bool = False, element: int = 2
) -> tuple[MmaSettings, ...]:
    """Distinct settings worth timing for an [n, k] weight in a ``block_m`` row block, the default
    first (what ``infer bench gemm`` measures): narrower and wider column blocks, K tiles of 128 and
    256, 3-4 stages, 8 warps, and the default without PDL; those whose pipeline would not fit in
    ``MAX_PIPELINE_BYTES`` are left out."""
    default = mma_settings(n, k, block_m, gated=gated, element=element)
    tries = (
        default,
        MmaSettings(block_n=16, block_k=256, num_stages=4),
        MmaSettings(block_n=32, block_k=128, num_stages=4),
        MmaSettings(block_n=64, block_k=128, num_stages=3),
        MmaSettings(block_n=32, block_k=256, num_stages=3, num_warps=8),
        MmaSettings(
            block_n=default.block_n,
            block_k=default.block_k,
            num_stages=default.num_stages,
            num_warps=default.num_warps,
            pdl=False,
        ),
    )
    fits = [s for s in tries if s.pipeline_bytes(block_m, element, gated=gated) <= MAX_PIPELINE_BYTES]
    return tuple(dict.fromkeys(fits))


# ---------------------------------------------------------------------------------------- kernel


@triton.jit
def _row_tile(
    x_tile,
    norm_w_ptr,
    k0,
    ks,
    row_ok,
    K,
    inv_rms,
    NORM: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    STORAGE: tl.constexpr,
):
    """The rows' K tile at ``k0`` (zeros past M and K), normalised with the spec's rounding points
    when ``NORM``; in the storage dtype, as the dot takes it."""
    k_ok = (ks + k0) < K
    a = tl.load(x_tile + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if NORM:
        if WEIGHT_MODE == WEIGHT_NONE:  # constexpr branch: no weight pointer to load
            norm_w = a.to(tl.float32)  # unread: _normalise ignores the weight without one
        else:
            norm_w = tl.load(norm_w_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        a = _normalise(a.to(tl.float32), inv_rms, norm_w, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE)
        a = a.to(STORAGE)  # exact: _normalise rounded to the storage dtype
    return a


# M is never specialised: one compiled kernel serves every row count of a row block.
@triton.jit(do_not_specialize=["M"])
def _fused_mma_kernel(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    KIND: tl.constexpr,
    STORAGE: tl.constexpr,
    PDL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its own weight loads
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N_OUT
    row_ok = rows < M
    # Weight offsets in int64: an LM head's N·K passes 2³¹ at larger vocabularies.
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
    up_tile = w_ptr + (cols + N_OUT)[:, None].to(tl.int64) * K + ks[None, :]  # the up half, gated
    x_tile = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    # The first weight tile (both halves), requested before anything waits.
    first_ok = col_ok[:, None] & (ks < K)[None, :]
    w_first = tl.load(w_tile, mask=first_ok, other=0.0)
    if GATED:  # noqa: SIM108 (constexpr branch)
        up_first = tl.load(up_tile, mask=first_ok, other=0.0)
    else:
        up_first = w_first
    if PDL:
        tl.extra.cuda.gdc_wait()  # x, residual and out belong to the previous kernel until now
    if NORM:  # each row's inverse RMS before the K loop: its sum of squares, tile by tile
        sum_squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for t in range(K_TILES):
            k_ok = (ks + t * BLOCK_K) < K
            h = tl.load(x_tile + t * BLOCK_K, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            h = h.to(tl.float32)
            sum_squares += tl.sum(h * h, axis=1)
        inv_rms = _inverse_rms_of_sum(sum_squares, K, eps)
    else:
        inv_rms = tl.zeros((BLOCK_M, 1), dtype=tl.float32)  # unread without the norm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a = _row_tile(
        x_tile, norm_w_ptr, 0, ks, row_ok, K, inv_rms, NORM, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE
    )
    acc = _accumulate(acc, a, w_first, DOT_FP32, IEEE)
    if GATED:
        up_acc = _accumulate(up_acc, a, up_first, DOT_FP32, IEEE)
    for t in range(1, K_TILES):  # the rest in one fixed order, pipelined by Triton
        k0 = t * BLOCK_K
        w_ok = col_ok[:, None] & ((ks + k0) < K)[None, :]
        w = tl.load(w_tile + k0, mask=w_ok, other=0.0)
        a = _row_tile(
            x_tile, norm_w_ptr, k0, ks, row_ok, K, inv_rms, NORM, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE
        )
        acc = _accumulate(acc, a, w, DOT_FP32, IEEE)
        if GATED:
            up = tl.load(up_tile + k0, mask=w_ok, other=0.0)
            up_acc = _accumulate(up_acc, a, up, DOT_FP32, IEEE)
    y = _round_to_storage(acc, STORAGE)
    if GATED:
        y = _gated_product(y, _round_to_storage(up_acc, STORAGE), KIND, STORAGE, LIBDEVICE)
    ok = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0)
        y = _round_to_storage(res.to(tl.float32) + y, STORAGE)  # torch's `residual + delta`
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


# -------------------------------------------------------------------------------------- launcher


def check_fused_mma(
    x: torch.Tensor,
    weight: torch.Tensor,
    fusion: Fusion,
    settings: MmaSettings,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> int:
    """Raise ``FusedMmaError`` naming the shape for anything ``fused_mma`` cannot run; returns the
    number of output columns (N, or I for a gated [2I, K] weight)."""
    name, n_out = check_fused_operands(
        x,
        weight,
        fusion,
        kernel="MMA",
        tag="mma",
        max_rows=MAX_ROWS,
        error=FusedMmaError,
        norm_weight=norm_weight,
        residual=residual,
        out=out,
    )
    m = x.shape[0]
    pipeline = settings.pipeline_bytes(row_block(m), x.element_size(), gated=fusion.activation is not None)
    if pipeline > MAX_PIPELINE_BYTES:
        raise FusedMmaError(
            f"{name}: settings {settings.label}: the pipeline holds {pipeline} bytes of shared memory "
            f"at {row_block(m)} rows, over the {MAX_PIPELINE_BYTES} a program may take"
        )
    return n_out


_fused_mma_launch = FastLaunch(_fused_mma_kernel)


def fused_mma(
    x: torch.Tensor,
    weight: torch.Tensor,
    fusion: Fusion = Fusion(),
    settings: MmaSettings | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch of the fused MMA for x [M ≤ MAX_ROWS, K] (any row stride) and a contiguous weight:
    the ops of ``fused_gemv`` (same ``Fusion``, same specs) on tensor cores, for the steps above the
    GEMV's 4 rows (it runs any M ≤ 64; the seam sends it 5 and up).

    ``settings`` default to ``mma_settings`` of the weight shape and the row block of M. ``out``
    (any row stride) receives the result; only its M rows are written. Raises ``FusedMmaError`` for
    anything it cannot run (``check_fused_mma``).
    """
    gated = fusion.activation is not None
    m, k = x.shape if x.dim() == 2 else (0, 0)
    if settings is None and weight.dim() == 2:
        n = weight.shape[0] // 2 if gated else weight.shape[0]
        settings = mma_settings(n, weight.shape[1], row_block(m), gated=gated, element=x.element_size())
    chosen = settings or MmaSettings()  # a misshapen weight: check_fused_mma names it
    n_out = check_fused_mma(x, weight, fusion, chosen, norm_weight=norm_weight, residual=residual, out=out)
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    pdl = chosen.pdl and pdl_supported(x.device)
    # No FMA contraction outside tl.dot: the norm's and epilogues' products round as the spec's do.
    launch: dict[str, object] = {
        "num_warps": chosen.num_warps,
        "num_stages": chosen.num_stages,
        "enable_fp_fusion": False,
    }
    if pdl:
        launch["launch_pdl"] = True
    spec = fusion.norm
    _fused_mma_launch[(ceil_div(n_out, chosen.block_n),)](
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
        BLOCK_M=row_block(m),
        BLOCK_N=chosen.block_n,
        BLOCK_K=chosen.block_k,
        K_TILES=ceil_div(k, chosen.block_k),
        NORM=spec is not None,
        WEIGHT_MODE=_MODES[spec.weight if spec is not None else NormWeight.NONE],
        ROUND_BEFORE_WEIGHT=spec.round_before_weight if spec is not None else False,
        RESIDUAL=fusion.residual,
        GATED=gated,
        KIND=_KINDS[fusion.activation or GatedActivation.SILU],
        STORAGE=STORAGE_TYPES[x.dtype],
        PDL=pdl,
        DOT_FP32=interpreted(),
        IEEE=x.dtype == torch.float32,
        LIBDEVICE=not interpreted(),
        **launch,
    )
    return y


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)

# Qwen3-4B's decode layer at its serving shapes ([N, K]; the gated weight is the fused [2I, K]),
# each at both row blocks, and Gemma 4 12B's widest K and its weightless-plus-one norm.
COMPILE_VARIANTS: tuple[tuple[Fusion, int, int], ...] = (
    (Fusion(norm=QWEN3), 6144, 2560),
    (Fusion(residual=True), 2560, 4096),
    (Fusion(norm=QWEN3, activation=GatedActivation.SILU), 19456, 2560),
    (Fusion(residual=True), 2560, 9728),
    (Fusion(), 151936, 2560),
    (Fusion(activation=GatedActivation.GELU_TANH), 30720, 3840),
)


def compile_variant(
    fusion: Fusion,
    n: int,
    k: int,
    block_m: int,
    dtype: torch.dtype = torch.bfloat16,
    settings: MmaSettings | None = None,
    *,
    arch: int = 90,
) -> object:
    """The compiled kernel (cubin and PTX) for one variant, PDL on, on ``sm_{arch}``, without a GPU."""
    gated = fusion.activation is not None
    n_out = n // 2 if gated else n
    element = torch.empty((), dtype=dtype).element_size()
    chosen = settings or mma_settings(n_out, k, block_m, gated=gated, element=element)
    spec = fusion.norm
    constexprs = {
        "BLOCK_M": block_m,
        "BLOCK_N": chosen.block_n,
        "BLOCK_K": chosen.block_k,
        "K_TILES": ceil_div(k, chosen.block_k),
        "NORM": spec is not None,
        "WEIGHT_MODE": _MODES[spec.weight if spec is not None else NormWeight.NONE].value,
        "ROUND_BEFORE_WEIGHT": spec.round_before_weight if spec is not None else False,
        "RESIDUAL": fusion.residual,
        "GATED": gated,
        "KIND": _KINDS[fusion.activation or GatedActivation.SILU].value,
        "STORAGE": STORAGE_TYPES[dtype],
        "PDL": True,
        "DOT_FP32": False,
        "IEEE": dtype == torch.float32,
        "LIBDEVICE": True,
    }
    # As the runtime JIT specialises at serving shapes: 16-aligned pointers, K, N and row strides.
    return compile_offline(
        _fused_mma_kernel,
        constexprs,
        storage_arg_type(dtype),
        pointers_and_strides(_fused_mma_kernel) | {"K", "N_OUT"},
        arch=arch,
        num_warps=chosen.num_warps,
        num_stages=chosen.num_stages,
        launch_pdl=True,
        enable_fp_fusion=False,
    )


def ptx_problems(ptx: str, has_cubin: bool, dtype: torch.dtype) -> list[str]:
    """What the compile check demands of a variant's PTX: a cubin, the PDL instructions, tensor-core
    instructions for bf16/fp16 (fp32 is IEEE fp32 on the CUDA cores: no TF32), and 16-byte weight
    loads (``cp.async`` 16 B into the pipeline, or ``ld.global.v4``)."""
    problems = [] if has_cubin else ["no cubin"]
    if not has_pdl_instructions(ptx):
        problems.append("no griddepcontrol instructions")
    tensor_cores = "mma.sync" in ptx or "wgmma" in ptx
    if tensor_cores != (dtype != torch.float32):
        problems.append(
            "tensor-core instructions for fp32" if tensor_cores else "no tensor-core instructions"
        )
    lines = ptx.splitlines()
    wide = any(
        ("ld.global" in line and (".v4." in line or ".v2.b64" in line))
        or ("cp.async" in line and ".global" in line and "0x10" in line)
        for line in lines
    )
    if not wide:
        problems.append("no 16-byte global loads")
    return problems


# Shared memory one block may take on sm_90 (227 KB): a build over it fails to launch.
SM90_SHARED_BYTES = 232448
# Where the benchmark's candidates are compiled too: Qwen3-4B's O projection, plain.
CANDIDATE_SHAPE = (2560, 4096)


def main() -> int:
    failures = []
    builds: list[tuple[Fusion, int, int, int, torch.dtype, MmaSettings | None]] = [
        (fusion, n, k, block_m, torch.bfloat16, None)
        for fusion, n, k in COMPILE_VARIANTS
        for block_m in ROW_BLOCKS
    ]
    # The other storage dtypes once each (fp32: IEEE fp32 on the CUDA cores).
    builds += [(Fusion(norm=QWEN3), 6144, 2560, 16, dtype, None) for dtype in (torch.float16, torch.float32)]
    # Every candidate `infer bench gemm` times, so none is first found unbuildable on the GPU.
    n, k = CANDIDATE_SHAPE
    builds += [
        (Fusion(), n, k, block_m, torch.bfloat16, settings)
        for block_m in ROW_BLOCKS
        for settings in mma_candidates(n, k, block_m)[1:]
    ]
    for fusion, n, k, block_m, dtype, settings in builds:
        kernel = compile_variant(fusion, n, k, block_m, dtype, settings)
        asm = getattr(kernel, "asm", {})
        problems = ptx_problems(str(asm.get("ptx", "")), bool(asm.get("cubin")), dtype)
        shared = int(getattr(getattr(kernel, "metadata", None), "shared", 0))
        if shared > SM90_SHARED_BYTES:
            problems.append(
                f"{shared} bytes of shared memory, over the {SM90_SHARED_BYTES} of an sm_90 block"
            )
        label = "" if settings is None else f" {settings.label}"
        what = f"{fusion.name} [{n}, {k}] m{block_m}{label} {str(dtype).removeprefix('torch.')}"
        if problems:
            failures.append(f"{what}: {', '.join(problems)}")
        print(f"compiled {what} ({shared} B shared)")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    run_compile_check(main)
