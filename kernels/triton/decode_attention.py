"""Paged decode attention: one query token per sequence, split-KV, batch-invariant by construction.

Computes `kernels.reference.attend_one_sequence` for steps whose every sequence has exactly one
query token, reading K and V straight from one layer's slice of the paged pool
(`[pages, 2, 16, kv_heads, head_dim]`, kernels/kv_layout.py) through each row's page table. GQA
without repeating KV: one program holds all `group = num_heads / num_kv_heads` query heads of its
KV head as the rows of one `[group, head_dim]` tile, so each K/V byte is read once per program.
Head dims 64, 128 and 256 (and 16, 32 for the tiny test checkpoints); sliding windows (`window` positions, the query's own included); the
softmax scale from the layer spec; bf16, fp16 or fp32 storage; the softmax and every sum in fp32.

Two launches:

* **Split kernel**, grid `(rows, kv_heads, PROGRAMS_PER_HEAD)`. A row's visible positions `[start,
  kv_len)` (`start = max(0, kv_len - window)`) are cut at absolute multiples of `SPLIT_TOKENS` (or
  the caller's `split_tokens`): split `s` covers `[s·SPLIT_TOKENS, (s+1)·SPLIT_TOKENS)`. Program `p`
  of (row, KV head) takes the splits `s ≡ p (mod PROGRAMS_PER_HEAD)` in increasing order and walks
  each in tiles of `BLOCK_N` tokens (a tile holds up to `TILE_ELEMENTS` values of K and at most a
  split: 64 tokens at head dim 64 and below, 32 at 128, 16 at 256), keeping a running max, sum and
  `[group, head_dim]` accumulator in fp32 (online softmax), and writes that partial to scratch. A
  program with no split writes nothing. Up to `SPLIT_TOKENS · PROGRAMS_PER_HEAD` = 1024 visible
  tokens each program holds at most one split, so its partial is that split's.
* **Merge kernel**, grid `(rows, num_heads)`. Loads all `PROGRAMS_PER_HEAD` partial slots of its
  query head at once (a slot whose program held no split masked to zero), takes the exact maximum
  of the maxima, sums `exp(m_j - M)·l_j` and `exp(m_j - M)·acc_j` over the slots in one fixed
  reduction tree, divides (IEEE) and rounds once to the storage dtype (nearest-even on every
  device, `_round_to_storage`).

Batch-invariant by construction: the split size, the tile, the number of programs and hence the
assignment of positions to programs (hence of splits to merge slots), the order each program folds
its tiles and the merge's tree are functions of the row's own `kv_len`, the window and the layer
geometry only, never of the batch size or another row's length. A row gets the same bits alone, inside any
batch, at any row offset, and on an eager step or a graph replay.

CUDA-graph safe: the grid is `(rows, kv_heads, PROGRAMS_PER_HEAD)`, fixed by the bucket and the
geometry; the KV lengths are read on the device, so one captured launch serves every step planned
into the same buffers. Chosen over a grid sized by the most splits any row could have (with early
exit) because that grid grows with the maximum context (at 40,960 tokens and 64-token splits, 640
programs per (row, KV head), nearly all exiting at once) and its scratch would hold one partial
per possible split (~1.3 GB at 256 Qwen3-4B rows); a fixed program count bounds both. The cost is
that a row longer than 1024 tokens is read by at most 16 programs per KV head (128 for Qwen3-4B's
8 KV heads at batch 1), each walking its splits one after another.

Scratch: per row `num_heads · PROGRAMS_PER_HEAD · (head_dim + 2) · 4` bytes of fp32 (the
accumulators, maxima and sums of every program), 266,240 B for Qwen3-4B (32 heads, head dim 128),
so 17 MB at 64 rows and 68 MB at 256. A scratch is dead between one merge and the next split
launch, so one per geometry serves every layer, every bucket and every eager step of one backend
instance (they run one after another on one stream); `DecodeScratch` is that buffer.

Positions and page-table entries are trusted inside the kernel (it cannot raise in a graph): page
table entries are read only for pages holding visible positions, and K/V only at visible positions,
so anything on other pages or past a row's table (sentinels, released sliding pages) cannot reach
the result. A padding row (every entry the padding page, kv_len 1) reads token 0 of page 0 and
writes only its own output row.

The two dots (`TENSOR_CORES`, bf16 and fp16 storage on the GPU): QKᵀ on the tensor cores straight
from the storage dtype (the products are exact, the sums fp32), and P·V in three-pass TF32
(`input_precision="tf32x3"`: P split into two TF32 parts, V exact in TF32, so fp32-class accuracy
with no rounding of P to 16 bits, which FlashInfer does). `pv_storage` takes FlashInfer's numerics
instead, and the serving backend asks for it (kernels/attention/triton_decode_backend.py,
`PV_STORAGE`, with the H100 figures): P rounded to the storage dtype and one 16-bit dot. That adds at
most u·max|v| to the error, u the storage dtype's unit roundoff (each p ≤ 1 moves by at most u·p,
and the sum of the fp32 p is the softmax's denominator; a p in fp16's subnormal range moves by at
most 2⁻²⁵), and halves the registers (Qwen3-4B's split kernel 119 against 224 in the sm_90 build,
so 4 programs fit an SM where 2 do). fp32 storage, and every dtype under
`TRITON_INTERPRET=1` (whose bf16 dot is wrong), take fp32 IEEE dots on the CUDA cores, with which a
64-row Qwen3-4B step took 22.3 ms against FlashInfer's 6.4 on an H100 (docs/benchmarks/qwen3.md). PDL on sm_90+
(kernels/triton/storage.py): both kernels let the next one launch at once and wait for the one
before only after reading the KV lengths (the split kernel also requests its first tile's K/V, all
but the newest position, before it waits), so the attention's reads start during the prep kernel
and the O projection after the merge can start streaming its weights during attention. The sm_90
build, PDL included, is checked offline (`python -m kernels.triton.decode_attention_aot`); the GPU
runs tests/kernels/test_decode_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention.base import AttentionLayerSpec
from kernels.kv_layout import PAGE_SIZE, check_pool_layer
from kernels.triton.launch import FastLaunch
from kernels.triton.prep_kernel import _round_to_storage
from kernels.triton.storage import STORAGE_TYPES, interpreted, next_power_of_2, pdl_supported

# Tokens per split, at absolute positions, by default. Never derived from the batch inside the kernel:
# that is the batch invariance. 64 tokens (4 pages) spreads a 512-token KV over 8 programs per KV
# head. A caller may pass another size (`split_tokens`), a power of two in SPLIT_TOKENS_RANGE; rows
# get the same bits under the same size only.
SPLIT_TOKENS = 64
SPLIT_TOKENS_RANGE = (16, 4096)
# Programs per (row, KV head). With 64-token splits one program holds one split up to 1024 tokens.
PROGRAMS_PER_HEAD = 16
# Values of K (and of V) in one program's tile: 8 KB of bf16, so a tile's K and V in fp32 stay
# within 64 registers per thread each at 4 warps.
TILE_ELEMENTS = 4096
# 64, 128 and 256 serve the real models; 16 and 32 are the tiny synthetic checkpoints' (CPU tests).
HEAD_DIMS = (16, 32, 64, 128, 256)
# The query heads of one KV head sit in one tile of at least 16 rows (tl.dot's minimum).
MAX_GROUP = 64
NUM_WARPS = 4


class DecodeAttentionError(ValueError):
    """Operands the decode kernel refuses; the message names the offending shape, dtype or value."""


@dataclass(frozen=True, slots=True)
class DecodeGeometry:
    """What a compiled kernel is specialised for: the layer's head counts and head dim."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, layer: AttentionLayerSpec) -> DecodeGeometry:
        return cls(layer.num_heads, layer.num_kv_heads, layer.head_dim)

    def problem(self) -> str | None:
        """Why the kernel cannot run this geometry; None when it can."""
        if self.head_dim not in HEAD_DIMS:
            return f"head_dim={self.head_dim} (the decode kernel takes {', '.join(map(str, HEAD_DIMS))})"
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            return f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
        if self.group > MAX_GROUP:
            return f"{self.group} query heads per KV head (at most {MAX_GROUP})"
        return None

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def group_pad(self) -> int:
        return max(16, next_power_of_2(self.group))

    def block_n(self, split_tokens: int = SPLIT_TOKENS) -> int:
        """Tokens per tile: up to `TILE_ELEMENTS` values of K, and never past a split."""
        return min(split_tokens, TILE_ELEMENTS // self.head_dim)

    @property
    def scratch_bytes_per_row(self) -> int:
        return self.num_heads * PROGRAMS_PER_HEAD * (self.head_dim + 2) * 4


def supports(layer: AttentionLayerSpec) -> bool:
    return DecodeGeometry.of(layer).problem() is None


def uses_tensor_cores(dtype: torch.dtype) -> bool:
    """Whether the split kernel takes its dots on the tensor cores (module doc): 16-bit storage on
    the GPU. The interpreter's bf16 dot is wrong, so it runs the fp32 dots (its fp16 dot is right:
    the CPU tests run the tensor-core program in fp16 by patching this)."""
    return dtype != torch.float32 and not interpreted()


@dataclass(slots=True)
class DecodeScratch:
    """The split kernel's fp32 partials for up to `rows` rows of one geometry: `acc [rows, Hkv,
    PROGRAMS_PER_HEAD, group, head_dim]` and `ml [rows, Hkv, PROGRAMS_PER_HEAD, 2, group]` (the
    running max, then the sum). Never initialised: the merge reads only partials written by the
    same launch pair."""

    geometry: DecodeGeometry
    acc: torch.Tensor
    ml: torch.Tensor

    @classmethod
    def allocate(cls, geometry: DecodeGeometry, rows: int, device: torch.device | str) -> DecodeScratch:
        g, p = geometry, PROGRAMS_PER_HEAD
        acc = torch.empty(rows, g.num_kv_heads, p, g.group, g.head_dim, dtype=torch.float32, device=device)
        ml = torch.empty(rows, g.num_kv_heads, p, 2, g.group, dtype=torch.float32, device=device)
        return cls(geometry, acc, ml)

    @property
    def rows(self) -> int:
        return int(self.acc.shape[0])


# ---------------------------------------------------------------------------------------- kernels


@triton.jit
def _visible_splits(kv_len, window, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The row's first visible position, the split holding it, and the number of splits up to
    kv_len (splits at absolute multiples of SPLIT: a function of the row alone)."""
    if HAS_WINDOW:  # noqa: SIM108 (constexpr branch)
        start = tl.maximum(kv_len - window, 0)
    else:
        start = kv_len * 0
    return start, start // SPLIT, (kv_len + SPLIT - 1) // SPLIT


@triton.jit(do_not_specialize=["window", "stride_table"])
def _decode_attention_split_kernel(
    q_ptr,
    pool_ptr,
    table_ptr,
    kv_len_ptr,
    acc_ptr,
    ml_ptr,
    scale,
    window,
    stride_q_row,
    stride_q_head,
    stride_page,
    stride_kv,
    stride_token,
    stride_head,
    stride_table,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PROGRAMS: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
    PDL: tl.constexpr,
    # P rounded to the storage dtype for the P·V dot (module doc, "The dots"); tensor cores only.
    PV_STORAGE: tl.constexpr = False,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    prog = tl.program_id(2)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the merge may launch now and wait for us
    # KV lengths and page tables come from host copies made before the step: readable before the
    # wait. So is every K/V position but the newest: earlier steps wrote them, and the plan's host
    # copies stand between two steps on the stream, so those writes completed before we launched.
    kv_len = tl.load(kv_len_ptr + row)
    start, first, n_splits = _visible_splits(kv_len, window, SPLIT, HAS_WINDOW)
    # This program's first split: the smallest s ≥ first with s ≡ prog (mod PROGRAMS).
    s0 = first + (prog - first % PROGRAMS + PROGRAMS) % PROGRAMS
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    table_row = table_ptr + row.to(tl.int64) * stride_table
    head = pool_ptr + kvh * stride_head
    # The program's first tile, requested before the wait (nothing when it has no split), so its
    # K/V are on their way while the prep kernel still runs.
    lo0 = tl.maximum(s0 * SPLIT, start)
    hi0 = tl.minimum(s0 * SPLIT + SPLIT, kv_len)
    t0 = lo0 // BLOCK_N
    pos0 = t0 * BLOCK_N + n
    ok0 = (pos0 >= lo0) & (pos0 < hi0)
    older0 = ok0 & (pos0 < kv_len - 1)
    slot0 = _token_slots(table_row, head, pos0, ok0, stride_page, stride_token, PAGE)
    k0 = tl.load(slot0[:, None] + d[None, :], mask=older0[:, None], other=0.0)
    v0 = tl.load(slot0[:, None] + stride_kv + d[None, :], mask=older0[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # q and the newest K/V are the prep kernel's output
    if s0 < n_splits:
        g = tl.arange(0, GROUP_PAD)
        g_ok = g < GROUP
        q_rows = q_ptr + row.to(tl.int64) * stride_q_row + (kvh * GROUP + g)[:, None] * stride_q_head
        # Rows past the group are zeros: their scores are finite and they are never stored.
        q = tl.load(q_rows + d[None, :], mask=g_ok[:, None], other=0.0)
        if not TENSOR_CORES:
            q = q.to(tl.float32)
        m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
        newest0 = (ok0 & (pos0 == kv_len - 1))[:, None]
        k0 = tl.load(slot0[:, None] + d[None, :], mask=newest0, other=k0)
        v0 = tl.load(slot0[:, None] + stride_kv + d[None, :], mask=newest0, other=v0)
        m_i, l_i, acc = _fold_tile(q, k0, v0, ok0, m_i, l_i, acc, scale, TENSOR_CORES, PV_STORAGE)
        for s in range(s0, n_splits, PROGRAMS):
            lo = tl.maximum(s * SPLIT, start)
            hi = tl.minimum(s * SPLIT + SPLIT, kv_len)
            # Tiles at absolute multiples of BLOCK_N, the first split's first one already folded;
            # each one walked holds a visible position, so the running max stays finite.
            t_from = tl.where(s == s0, t0 + 1, lo // BLOCK_N)
            for t in range(t_from, (hi + BLOCK_N - 1) // BLOCK_N):
                pos = t * BLOCK_N + n
                ok = (pos >= lo) & (pos < hi)
                slot = _token_slots(table_row, head, pos, ok, stride_page, stride_token, PAGE)
                k = tl.load(slot[:, None] + d[None, :], mask=ok[:, None], other=0.0)
                v = tl.load(slot[:, None] + stride_kv + d[None, :], mask=ok[:, None], other=0.0)
                m_i, l_i, acc = _fold_tile(q, k, v, ok, m_i, l_i, acc, scale, TENSOR_CORES, PV_STORAGE)
        part = (row.to(tl.int64) * KV_HEADS + kvh) * PROGRAMS + prog
        tl.store(acc_ptr + (part * GROUP + g)[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])
        tl.store(ml_ptr + part * 2 * GROUP + g, m_i, mask=g_ok)
        tl.store(ml_ptr + part * 2 * GROUP + GROUP + g, l_i, mask=g_ok)


@triton.jit
def _token_slots(table_row, head, pos, ok, stride_page, stride_token, PAGE: tl.constexpr):
    """Where positions ``pos`` of one KV head sit in the pool. Only visible positions (``ok``) touch
    the table, so nothing on other pages or past the row's table can leak in."""
    page = tl.load(table_row + pos // PAGE, mask=ok, other=0)
    return head + page.to(tl.int64) * stride_page + (pos % PAGE) * stride_token


@triton.jit
def _fold_tile(q, k, v, ok, m_i, l_i, acc, scale, TENSOR_CORES: tl.constexpr, PV_STORAGE: tl.constexpr):
    """One tile of K/V folded into the running max, sum and accumulator (online softmax). The sum
    takes the fp32 P; with ``PV_STORAGE`` the P·V dot takes P rounded to V's storage dtype."""
    if TENSOR_CORES:
        scores = tl.dot(q, tl.trans(k)) * scale
    else:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    scores = tl.where(ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if TENSOR_CORES and PV_STORAGE:
        pv = tl.dot(p.to(v.dtype), v)
    elif TENSOR_CORES:
        pv = tl.dot(p, v.to(tl.float32), input_precision="tf32x3")
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["window"])
def _decode_attention_merge_kernel(
    acc_ptr,
    ml_ptr,
    kv_len_ptr,
    out_ptr,
    window,
    stride_out_row,
    stride_out_head,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    PROGRAMS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    STORAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)  # one query head per program: every partial of it loaded at once
    kvh = h // GROUP
    gi = h % GROUP
    if PDL:
        # The next kernel (the O projection) may start streaming its weights while we merge.
        tl.extra.cuda.gdc_launch_dependents()
    kv_len = tl.load(kv_len_ptr + row)
    _start, first, n_splits = _visible_splits(kv_len, window, SPLIT, HAS_WINDOW)
    live = tl.minimum(n_splits - first, PROGRAMS)  # programs that wrote a partial, ≥ 1
    p = tl.arange(0, PROGRAMS)
    d = tl.arange(0, HEAD_DIM)
    # Program p holds split first + j with j ≡ p - first (mod PROGRAMS); it wrote iff j < live.
    wrote = (p - first % PROGRAMS + PROGRAMS) % PROGRAMS < live
    part = (row.to(tl.int64) * KV_HEADS + kvh) * PROGRAMS + p
    if PDL:
        tl.extra.cuda.gdc_wait()  # the partials are the split kernel's output
    m_p = tl.load(ml_ptr + part * 2 * GROUP + gi, mask=wrote, other=float("-inf"))
    l_p = tl.load(ml_ptr + part * 2 * GROUP + GROUP + gi, mask=wrote, other=0.0)
    a_p = tl.load(
        acc_ptr + (part * GROUP + gi)[:, None] * HEAD_DIM + d[None, :], mask=wrote[:, None], other=0.0
    )
    # The maximum is exact in any order; the two sums reduce over the program slots in one fixed
    # tree, a function of the row's own splits only (never of the batch).
    big_m = tl.max(m_p, axis=0)
    w = tl.where(wrote, tl.exp(m_p - big_m), 0.0)
    total = tl.sum(w * l_p, axis=0)
    acc = tl.sum(w[:, None] * a_p, axis=0)
    y = tl.div_rn(acc, total)
    out = out_ptr + row.to(tl.int64) * stride_out_row + h * stride_out_head
    tl.store(out + d, _round_to_storage(y, STORAGE).to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------- launcher


def check_decode(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    layer: AttentionLayerSpec,
    scratch: DecodeScratch | None,
    split_tokens: int = SPLIT_TOKENS,
) -> None:
    """Raise `DecodeAttentionError` naming the value if `decode_attention` cannot run these operands."""
    geometry = DecodeGeometry.of(layer)
    why = geometry.problem()
    if why is not None:
        raise DecodeAttentionError(f"decode attention: {why}")
    low, high = SPLIT_TOKENS_RANGE
    if split_tokens & (split_tokens - 1) or not low <= split_tokens <= high:
        raise DecodeAttentionError(
            f"decode attention: split_tokens={split_tokens} must be a power of two in [{low}, {high}]"
        )
    if layer.window is not None and layer.window < 1:
        raise DecodeAttentionError(f"decode attention: window={layer.window} must be at least 1")
    if q.dim() != 3 or tuple(q.shape[1:]) != (layer.num_heads, layer.head_dim):
        raise DecodeAttentionError(
            f"decode attention: q {tuple(q.shape)} is not [rows, {layer.num_heads}, {layer.head_dim}]"
        )
    if q.dtype not in STORAGE_TYPES or pool_layer.dtype != q.dtype:
        raise DecodeAttentionError(
            f"decode attention: q {q.dtype} and pool {pool_layer.dtype} must match and be bf16, fp16 or fp32"
        )
    if q.stride(-1) != 1:
        raise DecodeAttentionError(f"decode attention: q's head_dim must be dense, strides {q.stride()}")
    try:
        check_pool_layer(pool_layer, layer.num_kv_heads, layer.head_dim)
    except ValueError as exc:
        raise DecodeAttentionError(f"decode attention: {exc}") from exc
    rows = q.shape[0]
    if page_table.dim() != 2 or page_table.dtype != torch.int32 or page_table.shape[0] < rows:
        raise DecodeAttentionError(
            f"decode attention: page_table {tuple(page_table.shape)} {page_table.dtype} is not int32 "
            f"[≥ {rows}, pages]"
        )
    if page_table.stride(1) != 1:
        raise DecodeAttentionError(f"decode attention: page_table strides {page_table.stride()} (rows dense)")
    if kv_lens.dim() != 1 or kv_lens.dtype != torch.int32 or kv_lens.shape[0] < rows:
        raise DecodeAttentionError(
            f"decode attention: kv_lens {tuple(kv_lens.shape)} {kv_lens.dtype} is not int32 [≥ {rows}]"
        )
    devices = {q.device, pool_layer.device, page_table.device, kv_lens.device}
    if len(devices) != 1:
        raise DecodeAttentionError(f"decode attention: operands on {sorted(map(str, devices))}")
    if q.device.type != "cuda" and not interpreted():
        raise DecodeAttentionError(
            f"decode attention: device {q.device}; the Triton kernel needs CUDA (or TRITON_INTERPRET=1)"
        )
    if scratch is not None and (
        scratch.geometry != geometry or scratch.rows < rows or scratch.acc.device != q.device
    ):
        raise DecodeAttentionError(
            f"decode attention: scratch for {scratch.rows} rows of {scratch.geometry} on "
            f"{scratch.acc.device} cannot serve {rows} rows of {geometry} on {q.device}"
        )


_decode_attention_split_launch = FastLaunch(_decode_attention_split_kernel)
_decode_attention_merge_launch = FastLaunch(_decode_attention_merge_kernel)


def decode_attention(
    q: torch.Tensor,
    pool_layer: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    layer: AttentionLayerSpec,
    *,
    scratch: DecodeScratch | None = None,
    out: torch.Tensor | None = None,
    split_tokens: int = SPLIT_TOKENS,
    pv_storage: bool = False,
) -> torch.Tensor:
    """Attention of q `[rows, num_heads, head_dim]` (row i: one query at position `kv_lens[i] - 1`)
    over the row's `kv_lens[i]` positions on pages `page_table[i]` of `pool_layer`. Returns
    `[rows, num_heads, head_dim]` in q's dtype (into `out` when given, a dense tensor of that shape).

    `page_table` int32 `[≥ rows, pages]` and `kv_lens` int32 `[≥ rows]` live on q's device; only
    their first `rows` rows are read. `split_tokens` sets the split (module doc); a row's bits
    depend on it, never on the batch. `pv_storage` rounds P to the storage dtype for the P·V dot of
    the tensor-core program (module doc, "The dots"; the fp32 program has nothing to round). Host
    work is metadata only: no synchronisation, and with `scratch` and `out` given no allocation
    (CUDA-graph safe)."""
    check_decode(q, pool_layer, page_table, kv_lens, layer, scratch, split_tokens)
    geometry = DecodeGeometry.of(layer)
    rows = q.shape[0]
    if out is None:
        out = torch.empty(rows, layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or not out.is_contiguous():
        raise DecodeAttentionError(
            f"decode attention: out {tuple(out.shape)} {out.dtype} is not a dense {tuple(q.shape)} {q.dtype}"
        )
    if rows == 0:
        return out
    if scratch is None:
        scratch = DecodeScratch.allocate(geometry, rows, q.device)
    window = 0 if layer.window is None else layer.window
    pdl = pdl_supported(q.device)
    tensor_cores = uses_tensor_cores(q.dtype)
    shared = dict(
        KV_HEADS=layer.num_kv_heads,
        GROUP=geometry.group,
        HEAD_DIM=layer.head_dim,
        SPLIT=split_tokens,
        PROGRAMS=PROGRAMS_PER_HEAD,
        HAS_WINDOW=layer.window is not None,
        PDL=pdl,
    )
    # No FMA contraction: the spec multiplies and adds separately (as in every kernel here).
    launch: dict[str, object] = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}
    if pdl:
        launch["launch_pdl"] = True
    _decode_attention_split_launch[(rows, layer.num_kv_heads, PROGRAMS_PER_HEAD)](
        q,
        pool_layer,
        page_table,
        kv_lens,
        scratch.acc,
        scratch.ml,
        layer.scale,
        window,
        q.stride(0),
        q.stride(1),
        pool_layer.stride(0),
        pool_layer.stride(1),
        pool_layer.stride(2),
        pool_layer.stride(3),
        page_table.stride(0),
        GROUP_PAD=geometry.group_pad,
        BLOCK_N=geometry.block_n(split_tokens),
        PAGE=PAGE_SIZE,
        TENSOR_CORES=tensor_cores,
        PV_STORAGE=pv_storage and tensor_cores,
        **shared,
        **launch,
    )
    _decode_attention_merge_launch[(rows, layer.num_heads)](
        scratch.acc,
        scratch.ml,
        kv_lens,
        out,
        window,
        out.stride(0),
        out.stride(1),
        STORAGE=STORAGE_TYPES[q.dtype],
        **shared,
        **launch,
    )
    return out
