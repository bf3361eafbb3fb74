"""One decode step of the gated delta rule, reading and writing the state pool in place by slot.

fla-core's recurrent op allocates a new state and takes no slot indices, so a serving decode on it
would gather ``pool[slots]`` and scatter the result back: two extra round trips of the state,
which is most of what a decode step of this layer moves. This kernel reads ``pool[slot]``, applies
one token's update (``kernels.reference.gated_delta_rule`` with one token per sequence) and writes
it back where it was.

Each program owns one sequence, one value head and ``BLOCK_V`` rows of that head's ``[V, K]``
state. Rows of the state are independent in the update (row ``i`` reads only ``S[i, :]``, ``k̂``,
``q̂``, ``v[i]``, ``β`` and ``g``), so splitting V across programs changes nothing, and the sums over
K stay inside one program whose tile shape depends on the geometry only: a row's bits never depend
on the batch. q and k are read at key head ``h // (Hv / Hk)`` and L2-normed in fp32 in registers.

With ``RAW_GATES`` (``gdn_decode_step_with_gates``) the kernel reads the projection's ``a`` and ``b``
instead of ``g`` and ``β`` and computes them in its prologue, ``kernels.reference.gdn_gates`` per
(sequence, value head): ``g = −exp(A_log)·softplus(a + dt_bias)`` in fp32 (softplus as torch's:
``x`` above 20, else ``log1p(exp(x))``), ``β = R(sigmoid(b))``; the programs of one head compute the
same scalars from the same loads, so they agree bit for bit.

Fresh sequences read zeros instead of their slot (the slot may hold a finished request's state).
Slots must be distinct except for the padding slot 0, which CUDA-graph filler rows share and
nothing reads. One launch, no host synchronisation: graph-safe.

``python -m kernels.triton.gdn_decode`` compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.reference import L2_NORM_EPS, SpecError
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import compile_offline, has_cubin, pointers_and_strides, run_compile_check
from kernels.triton.prep_kernel import _round_to_storage
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES, interpreted, next_power_of_2

# Value rows per program. 32 × 128 fp32 is 16 KiB of state per program at K = 128: small enough
# that a batch-1 step still has Hv · V / 32 programs (128 at the 4B geometry) to spread over SMs.
BLOCK_V = 32
NUM_WARPS = 4


class GDNDecodeError(SpecError):
    """An input the decode kernel cannot take; the message names the tensor and what is wrong."""


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.exp(x)
    else:  # the interpreter's exp is numpy's
        return tl.exp(x)


@triton.jit
def _log1p(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.log1p(x)
    else:  # the interpreter has no log1p; this form (Goldberg's) is exact to a few fp32 ulps
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * tl.div_rn(x, u - 1.0))


@triton.jit
def _gates(a, b, a_log, dt_bias, BETA_STORAGE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``reference.gdn_gates`` of fp32 scalars: ``(g, β)``, β rounded to b's storage dtype."""
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, _log1p(_exp(x, LIBDEVICE), LIBDEVICE))
    g = -_exp(a_log, LIBDEVICE) * softplus
    beta = _round_to_storage(tl.div_rn(1.0, 1.0 + _exp(-b, LIBDEVICE)), BETA_STORAGE)
    return g, beta


@triton.jit
def _gdn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,  # with RAW_GATES: the projection's a
    beta_ptr,  # with RAW_GATES: the projection's b
    a_log_ptr,  # read with RAW_GATES only
    dt_bias_ptr,  # read with RAW_GATES only
    slots_ptr,
    fresh_ptr,
    state_ptr,
    o_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_g_tok,
    stride_beta_tok,
    stride_state_slot,
    stride_o_tok,
    stride_o_head,
    scale,
    eps,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    RAW_GATES: tl.constexpr,
    BETA_STORAGE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < V
    col_ok = cols < K
    key_head = head // GROUP

    q = tl.load(q_ptr + seq * stride_q_tok + key_head * stride_q_head + cols, mask=col_ok, other=0.0)
    k = tl.load(k_ptr + seq * stride_k_tok + key_head * stride_k_head + cols, mask=col_ok, other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    # l2(x) = x · rsqrt(Σx² + eps), with an IEEE square root and divide (rsqrt is approximate).
    q_hat = q * tl.div_rn(1.0, tl.sqrt_rn(tl.sum(q * q, axis=0) + eps)) * scale
    k_hat = k * tl.div_rn(1.0, tl.sqrt_rn(tl.sum(k * k, axis=0) + eps))

    slot = tl.load(slots_ptr + seq).to(tl.int64)
    fresh = tl.load(fresh_ptr + seq)
    tile = rows[:, None] * K + cols[None, :]
    tile_ok = row_ok[:, None] & col_ok[None, :]
    head_state = state_ptr + slot * stride_state_slot + head * (V * K)
    # A fresh row's slot is not read at all (the mask broadcast to the tile, as the interpreter
    # takes no scalar term in a mask).
    keep = (tl.zeros([BLOCK_V, BLOCK_K], dtype=tl.int32) + (fresh == 0).to(tl.int32)) != 0
    state = tl.load(head_state + tile, mask=tile_ok & keep, other=0.0)

    gate_in = tl.load(g_ptr + seq * stride_g_tok + head).to(tl.float32)
    beta = tl.load(beta_ptr + seq * stride_beta_tok + head).to(tl.float32)
    if RAW_GATES:
        a_log = tl.load(a_log_ptr + head).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
        gate_in, beta = _gates(gate_in, beta, a_log, dt_bias, BETA_STORAGE, LIBDEVICE)
    decay = _exp(gate_in, LIBDEVICE)
    v = tl.load(v_ptr + seq * stride_v_tok + head * stride_v_head + rows, mask=row_ok, other=0.0)
    state = state * decay
    predicted = tl.sum(state * k_hat[None, :], axis=1)
    delta = beta * (v.to(tl.float32) - predicted)
    state = state + delta[:, None] * k_hat[None, :]
    out = tl.sum(state * q_hat[None, :], axis=1)

    tl.store(head_state + tile, state, mask=tile_ok)
    o_row = o_ptr + seq * stride_o_tok + head * stride_o_head
    tl.store(o_row + rows, out.to(o_ptr.dtype.element_ty), mask=row_ok)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(t.shape) != shape:
        raise GDNDecodeError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise GDNDecodeError(f"{name} is on {t.device}, the state pool on {device}")


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    state_pool: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One token per sequence: ``q, k [N, Hk, K]``, ``v [N, Hv, V]``, ``g, beta [N, Hv]`` (g in
    log space), ``slots [N]`` int64, ``fresh [N]`` bool, ``state_pool [slots, Hv, V, K]`` fp32,
    updated in place. Returns ``o [N, Hv, V]`` in v's dtype."""
    sequences, heads = _check_step(q, k, v, slots, fresh, state_pool)
    device = state_pool.device
    _check("g", g, (sequences, heads), device)
    _check("beta", beta, (sequences, heads), device)
    # a_log and dt_bias are not read without RAW_GATES: g and beta stand in for the pointers.
    return _launch(q, k, v, g, beta, g, beta, slots, fresh, state_pool, scale, raw_gates=False)


def gdn_decode_step_with_gates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    state_pool: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``reference.gdn_gates(a, b, a_log, dt_bias)`` and then ``gdn_decode_step`` with its g and β, in
    one launch: ``a, b [N, Hv]`` (strided row views of the projection are fine), ``a_log, dt_bias
    [Hv]``; β rounds to b's dtype. The rest as ``gdn_decode_step``."""
    sequences, heads = _check_step(q, k, v, slots, fresh, state_pool)
    device = state_pool.device
    _check("a", a, (sequences, heads), device)
    _check("b", b, (sequences, heads), device)
    _check("a_log", a_log, (heads,), device)
    _check("dt_bias", dt_bias, (heads,), device)
    for name, t in (("a", a), ("b", b), ("a_log", a_log), ("dt_bias", dt_bias)):
        if t.dtype not in STORAGE_TYPES:
            raise GDNDecodeError(f"{name} must be bf16, fp16 or fp32, got {t.dtype}")
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    return _launch(q, k, v, a, b, a_log, dt_bias, slots, fresh, state_pool, scale, raw_gates=True)


def _check_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    state_pool: torch.Tensor,
) -> tuple[int, int]:
    """The checks both entry points share; returns (sequences, value heads)."""
    if q.dim() != 3 or v.dim() != 3:
        raise GDNDecodeError(f"q must be [N, Hk, K] and v [N, Hv, V], got {list(q.shape)}, {list(v.shape)}")
    sequences, key_heads, key_dim = q.shape
    heads, value_dim = v.shape[1], v.shape[2]
    device = state_pool.device
    if heads % key_heads:
        raise GDNDecodeError(f"{heads} value heads are not a multiple of {key_heads} key heads")
    if state_pool.dtype != torch.float32:
        raise GDNDecodeError(f"state_pool must be float32, got {state_pool.dtype}")
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (heads, value_dim, key_dim):
        raise GDNDecodeError(
            f"state_pool must be [slots, {heads}, {value_dim}, {key_dim}], got {list(state_pool.shape)}"
        )
    if not state_pool[0].is_contiguous():
        raise GDNDecodeError("state_pool must be contiguous within a slot ([Hv, V, K] row-major)")
    _check("q", q, (sequences, key_heads, key_dim), device)
    _check("k", k, (sequences, key_heads, key_dim), device)
    _check("v", v, (sequences, heads, value_dim), device)
    _check("slots", slots, (sequences,), device)
    _check("fresh", fresh, (sequences,), device)
    if slots.dtype != torch.int64 or fresh.dtype != torch.bool:
        raise GDNDecodeError(f"slots must be int64 and fresh bool, got {slots.dtype}, {fresh.dtype}")
    if v.dtype not in STORAGE_TYPES or q.dtype != v.dtype or k.dtype != v.dtype:
        raise GDNDecodeError(
            f"q, k, v must share one of bf16, fp16, fp32, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if device.type != "cuda" and not interpreted():
        raise GDNDecodeError(f"device {device}: the Triton decode kernel needs CUDA (or TRITON_INTERPRET=1)")
    return sequences, heads


_gdn_decode_launch = FastLaunch(_gdn_decode_kernel)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    state_pool: torch.Tensor,
    scale: float | None,
    *,
    raw_gates: bool,
) -> torch.Tensor:
    """One launch on checked inputs; ``g``, ``beta`` hold a, b when ``raw_gates``."""
    sequences, key_heads, key_dim = q.shape
    heads, value_dim = v.shape[1], v.shape[2]
    q, k, v = _last_dim_unit(q), _last_dim_unit(k), _last_dim_unit(v)
    g, beta = _last_dim_unit(g), _last_dim_unit(beta)
    out = torch.empty((sequences, heads, value_dim), dtype=v.dtype, device=state_pool.device)
    if sequences == 0:
        return out
    scale = key_dim**-0.5 if scale is None else scale
    grid = (sequences, heads, ceil_div(value_dim, BLOCK_V))
    _gdn_decode_launch[grid](
        q,
        k,
        v,
        g,
        beta,
        a_log,
        dt_bias,
        slots,
        fresh.view(torch.uint8),  # a byte per row: the interpreter takes no bool mask from a bool load
        state_pool,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        state_pool.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        L2_NORM_EPS,
        **_constexprs(heads // key_heads, key_dim, value_dim, raw_gates, beta.dtype),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # every multiply and add rounded on its own, as the spec's torch ops
    )
    return out


def _constexprs(
    group: int, key_dim: int, value_dim: int, raw_gates: bool = False, beta_dtype: torch.dtype = torch.float32
) -> dict[str, object]:
    return {
        "GROUP": group,
        "K": key_dim,
        "V": value_dim,
        "BLOCK_K": next_power_of_2(key_dim),
        "BLOCK_V": min(BLOCK_V, next_power_of_2(value_dim)),
        "LIBDEVICE": not interpreted(),
        "RAW_GATES": raw_gates,
        "BETA_STORAGE": STORAGE_TYPES.get(beta_dtype, tl.float32),
    }


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)

# (value heads per key head, K, V): Qwen3.5's GDN geometries (shared/presets.md: 0.8B/2B 16/16,
# 4B/9B 16/32, 27B 16/48; K = V = 128 throughout).
SERVING_VARIANTS: tuple[tuple[int, int, int], ...] = ((1, 128, 128), (2, 128, 128), (3, 128, 128))


def compile_variant(
    group: int, key_dim: int, value_dim: int, dtype: torch.dtype, arch: int = 90, *, raw_gates: bool = False
) -> object:
    """The compiled kernel (cubin included) for one variant on ``sm_{arch}``, without a GPU. With
    ``raw_gates`` a and b hold ``dtype`` (the projection's), A_log is fp32 and dt_bias ``dtype``, as
    the checkpoints store them; without, g is fp32 and β ``dtype``."""
    pointer = {
        "g_ptr": POINTER_TYPES[dtype] if raw_gates else "*fp32",
        "state_ptr": "*fp32",
        "slots_ptr": "*i64",
        "fresh_ptr": "*u8",
        "beta_ptr": POINTER_TYPES[dtype],
        "a_log_ptr": "*fp32",
    }

    def arg_type(name: str) -> str:
        if name.endswith("_ptr"):
            return pointer.get(name, POINTER_TYPES[dtype])
        return "fp32" if name in ("scale", "eps") else "i32"

    # Serving shapes: 16-byte aligned buffers, strides that are multiples of 16 elements; the
    # per-row ``fresh`` bytes are left unmarked, and so are a and b (views at the projection's
    # columns past qkv and z) and their strides, which the JIT need not see divisible.
    unaligned = {"fresh_ptr"} | (
        {"g_ptr", "beta_ptr", "stride_g_tok", "stride_beta_tok"} if raw_gates else set()
    )
    return compile_offline(
        _gdn_decode_kernel,
        _constexprs(group, key_dim, value_dim, raw_gates, dtype) | {"LIBDEVICE": True},
        arg_type,
        pointers_and_strides(_gdn_decode_kernel) - unaligned,
        arch=arch,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


def main() -> int:
    for group, key_dim, value_dim in SERVING_VARIANTS:
        for dtype in POINTER_TYPES:
            for raw_gates in (False, True):
                kernel = compile_variant(group, key_dim, value_dim, dtype, raw_gates=raw_gates)
                if not has_cubin(kernel):
                    print(f"no cubin for group={group} {dtype} raw_gates={raw_gates}", file=sys.stderr)
                    return 1
        print(
            f"compiled gdn_decode group={group} K={key_dim} V={value_dim} (g, β given or from a, b) for sm_90"
        )
    return 0


if __name__ == "__main__":
    run_compile_check(main)
