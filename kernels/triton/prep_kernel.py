"""The fused attention-prep Triton kernel: QK-norm, rotary and the paged K/V write in one launch.

Semantics and rounding points are those of ``kernels.reference`` (read its module doc first); this
file only restates them in Triton. One program handles one token row and a block of heads: the
first ``NUM_Q_BLOCKS`` programs of a row take Q heads, the rest take KV heads (K, and V with it).

Every rounding to the storage dtype goes through ``_round_to_storage`` rather than ``.to()``: the
interpreter truncates fp32 → bf16 while the GPU rounds to nearest-even, and the tests run on the
interpreter. Stores then see values the storage dtype represents exactly, so any cast is exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Codes the launcher passes for the reference's enums (Triton globals must be constexpr).
WEIGHT_NONE = tl.constexpr(0)
WEIGHT_W = tl.constexpr(1)
WEIGHT_ONE_PLUS_W = tl.constexpr(2)
V_PROJECTION = tl.constexpr(0)
V_NORMED_PROJECTION = tl.constexpr(1)
V_NORMED_RAW_K = tl.constexpr(2)


@triton.jit
def _round_to_storage(x, STORAGE: tl.constexpr):
    """Round fp32 ``x`` to the storage dtype, nearest-even, and keep it as fp32."""
    if STORAGE == tl.bfloat16:  # noqa: SIM300 (constexpr parameter, not a constant)
        bits = x.to(tl.uint32, bitcast=True)
        # Add just under half a bf16 ulp, plus the lowest kept bit for ties-to-even, then cut.
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = rounded.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, y)
    elif STORAGE == tl.float16:  # noqa: SIM300
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _inverse_rms(x, eps, HEAD_DIM: tl.constexpr):
    """``1 / sqrt(mean(x²) + eps)`` per head (rows of the tile), IEEE sqrt and divide, as [heads, 1]."""
    # HEAD_DIM is a power of two, so scaling by its reciprocal is the exact division torch's mean does.
    mean_square = tl.sum(x * x, axis=1) * (1.0 / HEAD_DIM)
    return tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))[:, None]


@triton.jit
def _normalise(
    x, inv_rms, weight, WEIGHT_MODE: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, STORAGE: tl.constexpr
):
    normalised = x * inv_rms
    if WEIGHT_MODE == WEIGHT_NONE:
        y = _round_to_storage(normalised, STORAGE)
    else:
        scale = 1.0 + weight if WEIGHT_MODE == WEIGHT_ONE_PLUS_W else weight
        if ROUND_BEFORE_WEIGHT:
            y = _round_to_storage(scale * _round_to_storage(normalised, STORAGE), STORAGE)
        else:
            y = _round_to_storage(normalised * scale, STORAGE)
    return y


@triton.jit
def _rotate(a, partner, cos, sin, is_first, is_second, STORAGE: tl.constexpr):
    """Rotate-half with the reference's rounding points; dims outside both halves pass through."""
    along = _round_to_storage(a * cos, STORAGE)
    across = _round_to_storage(partner * sin, STORAGE)
    first = _round_to_storage(along - across, STORAGE)
    second = _round_to_storage(along + across, STORAGE)
    return tl.where(is_first, first, tl.where(is_second, second, a))


@triton.jit
def _rotation_geometry(HEAD_DIM: tl.constexpr, TURNING_PAIRS: tl.constexpr, PAIR_OFFSET: tl.constexpr):
    """Per dim: in the first or second half of a turning pair, its partner dim, its frequency index.

    Dims outside both halves are their own partner and pass through unrotated.
    """
    dims = tl.arange(0, HEAD_DIM)
    is_first = dims < TURNING_PAIRS
    is_second = (dims >= PAIR_OFFSET) & (dims < PAIR_OFFSET + TURNING_PAIRS)
    partner_dims = tl.where(is_first, dims + PAIR_OFFSET, tl.where(is_second, dims - PAIR_OFFSET, dims))
    freq_index = tl.where(is_first, dims, tl.where(is_second, dims - PAIR_OFFSET, 0))
    return dims, is_first, is_second, partner_dims, freq_index


@triton.jit
def _norm_rotate_heads(
    src,
    weight_ptr,
    eps,
    head_ok,
    cos,
    sin,
    HEAD_DIM: tl.constexpr,
    TURNING_PAIRS: tl.constexpr,
    PAIR_OFFSET: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    STORAGE: tl.constexpr,
):
    """Norm then rotate a [heads, HEAD_DIM] tile at ``src``; returns (rotated, raw fp32, inverse rms).

    A dim's rotation partner is loaded a second time rather than shuffled between threads; it is
    normalised with the head's own inverse RMS, so it equals the partner's normalised value bit
    for bit.
    """
    dims, is_first, is_second, partner_dims, _ = _rotation_geometry(HEAD_DIM, TURNING_PAIRS, PAIR_OFFSET)
    turning = (is_first | is_second)[None, :]
    x = tl.load(src + dims[None, :], mask=head_ok, other=0.0).to(tl.float32)
    x_partner = tl.load(src + partner_dims[None, :], mask=head_ok & turning, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + dims).to(tl.float32)[None, :]
    weight_partner = tl.load(weight_ptr + partner_dims).to(tl.float32)[None, :]
    inv_rms = _inverse_rms(x, eps, HEAD_DIM)
    a = _normalise(x, inv_rms, weight, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE)
    b = _normalise(x_partner, inv_rms, weight_partner, WEIGHT_MODE, ROUND_BEFORE_WEIGHT, STORAGE)
    rotated = _rotate(a, b, cos[None, :], sin[None, :], is_first[None, :], is_second[None, :], STORAGE)
    return rotated, x, inv_rms


@triton.jit
def _kv_values(
    k_src,
    v_src,
    k_weight_ptr,
    k_eps,
    head_ok,
    cos,
    sin,
    HEAD_DIM: tl.constexpr,
    TURNING_PAIRS: tl.constexpr,
    PAIR_OFFSET: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    V_SOURCE: tl.constexpr,
    STORAGE: tl.constexpr,
):
    """The K and V rows a [heads, HEAD_DIM] tile of KV heads stores (``k_src``, ``v_src``: the heads'
    rows of the projection): K normed and rotated (fp32, storage-rounded); V as projected (in the
    storage dtype), normalised (fp32, storage-rounded), or derived from K's raw rows and inverse RMS."""
    k_rot, k_raw, k_inv_rms = _norm_rotate_heads(
        k_src,
        k_weight_ptr,
        k_eps,
        head_ok,
        cos,
        sin,
        HEAD_DIM,
        TURNING_PAIRS,
        PAIR_OFFSET,
        WEIGHT_MODE,
        ROUND_BEFORE_WEIGHT,
        STORAGE,
    )
    dims = tl.arange(0, HEAD_DIM)[None, :]
    if V_SOURCE == V_PROJECTION:
        v = tl.load(v_src + dims, mask=head_ok)
    elif V_SOURCE == V_NORMED_PROJECTION:
        v_raw = tl.load(v_src + dims, mask=head_ok, other=0.0).to(tl.float32)
        v = _normalise(v_raw, _inverse_rms(v_raw, k_eps, HEAD_DIM), v_raw, WEIGHT_NONE, False, STORAGE)
    else:
        # Gemma 4 global: V is the raw K row under a weightless norm, sharing K's inverse RMS.
        v = _normalise(k_raw, k_inv_rms, k_raw, WEIGHT_NONE, False, STORAGE)
    return k_rot, v


@triton.jit
def _prep_q_block(
    q_ptr,
    q_weight_ptr,
    q_out_ptr,
    gate_out_ptr,
    row,
    block,
    q_eps,
    cos,
    sin,
    stride_q_row,
    stride_q_head,
    stride_qo_row,
    stride_qo_head,
    stride_go_row,
    stride_go_head,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    Q_GATED: tl.constexpr,
    TURNING_PAIRS: tl.constexpr,
    PAIR_OFFSET: tl.constexpr,
    STORAGE: tl.constexpr,
):
    dims = tl.arange(0, HEAD_DIM)[None, :]
    heads = block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    head_ok = (heads < NUM_Q_HEADS)[:, None]
    heads = heads[:, None].to(tl.int64)
    src = q_ptr + row * stride_q_row + heads * stride_q_head
    q_rot, _, _ = _norm_rotate_heads(
        src,
        q_weight_ptr,
        q_eps,
        head_ok,
        cos,
        sin,
        HEAD_DIM,
        TURNING_PAIRS,
        PAIR_OFFSET,
        WEIGHT_MODE,
        ROUND_BEFORE_WEIGHT,
        STORAGE,
    )
    tl.store(q_out_ptr + row * stride_qo_row + heads * stride_qo_head + dims, q_rot.to(STORAGE), mask=head_ok)
    if Q_GATED:
        # The gate sits after Q inside each head's input and is copied untouched.
        gate = tl.load(src + HEAD_DIM + dims, mask=head_ok)
        tl.store(gate_out_ptr + row * stride_go_row + heads * stride_go_head + dims, gate, mask=head_ok)


@triton.jit
def _prep_kv_block(
    k_ptr,
    v_ptr,
    k_weight_ptr,
    pool_ptr,
    row,
    block,
    position,
    page,
    k_eps,
    cos,
    sin,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_pool_page,
    stride_pool_kv,
    stride_pool_token,
    stride_pool_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    WEIGHT_MODE: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    V_SOURCE: tl.constexpr,
    TURNING_PAIRS: tl.constexpr,
    PAIR_OFFSET: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    STORAGE: tl.constexpr,
):
    dims = tl.arange(0, HEAD_DIM)[None, :]
    heads = block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    head_ok = (heads < NUM_KV_HEADS)[:, None]
    heads = heads[:, None].to(tl.int64)
    token = position % PAGE_SIZE
    k_dst = pool_ptr + page * stride_pool_page + token * stride_pool_token + heads * stride_pool_head + dims
    v_dst = k_dst + stride_pool_kv

    k_rot, v = _kv_values(
        k_ptr + row * stride_k_row + heads * stride_k_head,
        v_ptr + row * stride_v_row + heads * stride_v_head,
        k_weight_ptr,
        k_eps,
        head_ok,
        cos,
        sin,
        HEAD_DIM,
        TURNING_PAIRS,
        PAIR_OFFSET,
        WEIGHT_MODE,
        ROUND_BEFORE_WEIGHT,
        V_SOURCE,
        STORAGE,
    )
    tl.store(k_dst, k_rot.to(STORAGE), mask=head_ok)
    tl.store(v_dst, v.to(STORAGE), mask=head_ok)


@triton.jit
def attention_prep_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_weight_ptr,
    k_weight_ptr,
    rope_ptr,
    positions_ptr,
    seq_index_ptr,
    page_table_ptr,
    pool_ptr,
    q_out_ptr,
    gate_out_ptr,
    row_offset,
    q_eps,
    k_eps,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_qo_row,
    stride_qo_head,
    stride_go_row,
    stride_go_head,
    stride_rope_position,
    stride_rope_kind,
    stride_page_table_row,
    stride_pool_page,
    stride_pool_kv,
    stride_pool_token,
    stride_pool_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Q_BLOCK_HEADS: tl.constexpr,
    KV_BLOCK_HEADS: tl.constexpr,
    NUM_Q_BLOCKS: tl.constexpr,
    Q_WEIGHT_MODE: tl.constexpr,
    Q_ROUND_BEFORE_WEIGHT: tl.constexpr,
    K_WEIGHT_MODE: tl.constexpr,
    K_ROUND_BEFORE_WEIGHT: tl.constexpr,
    V_SOURCE: tl.constexpr,
    Q_GATED: tl.constexpr,
    TURNING_PAIRS: tl.constexpr,
    PAIR_OFFSET: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    STORAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) + row_offset
    block = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # attention may launch now and wait for us
    # Positions come from host copies made before the step and the rope table never changes: both
    # are read before the wait, while the projection before us finishes.
    position = tl.load(positions_ptr + row).to(tl.int64)
    _, is_first, is_second, _, freq_index = _rotation_geometry(HEAD_DIM, TURNING_PAIRS, PAIR_OFFSET)
    turning = is_first | is_second
    rope_row = rope_ptr + position * stride_rope_position + freq_index
    cos = tl.load(rope_row, mask=turning, other=1.0).to(tl.float32)
    sin = tl.load(rope_row + stride_rope_kind, mask=turning, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # q, k and v are the projection's output

    if block < NUM_Q_BLOCKS:
        _prep_q_block(
            q_ptr,
            q_weight_ptr,
            q_out_ptr,
            gate_out_ptr,
            row,
            block,
            q_eps,
            cos,
            sin,
            stride_q_row,
            stride_q_head,
            stride_qo_row,
            stride_qo_head,
            stride_go_row,
            stride_go_head,
            NUM_Q_HEADS,
            HEAD_DIM,
            Q_BLOCK_HEADS,
            Q_WEIGHT_MODE,
            Q_ROUND_BEFORE_WEIGHT,
            Q_GATED,
            TURNING_PAIRS,
            PAIR_OFFSET,
            STORAGE,
        )
    else:
        seq = tl.load(seq_index_ptr + row).to(tl.int64)
        page = tl.load(page_table_ptr + seq * stride_page_table_row + position // PAGE_SIZE).to(tl.int64)
        _prep_kv_block(
            k_ptr,
            v_ptr,
            k_weight_ptr,
            pool_ptr,
            row,
            block - NUM_Q_BLOCKS,
            position,
            page,
            k_eps,
            cos,
            sin,
            stride_k_row,
            stride_k_head,
            stride_v_row,
            stride_v_head,
            stride_pool_page,
            stride_pool_kv,
            stride_pool_token,
            stride_pool_head,
            NUM_KV_HEADS,
            HEAD_DIM,
            KV_BLOCK_HEADS,
            K_WEIGHT_MODE,
            K_ROUND_BEFORE_WEIGHT,
            V_SOURCE,
            TURNING_PAIRS,
            PAIR_OFFSET,
            PAGE_SIZE,
            STORAGE,
        )
