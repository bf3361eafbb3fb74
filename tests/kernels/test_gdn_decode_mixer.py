"""The fused GDN decode mixer (kernels/gdn/decode_mixer.py) and its three kernels against the spec and
against themselves: the conv step (kernels/triton/gdn_conv_step.py), the decode step with the gates
in its prologue (``gdn_decode_step_with_gates``) and the gated norm (kernels/triton/gdn_gated_norm.py).

Runs on the GPU when there is one, otherwise under Triton's interpreter (tests/kernels/conftest.py).
Spec anchors: each kernel against its spec op (``causal_conv1d``, ``gdn_gates`` + ``gated_delta_rule``,
``gated_rms_norm``) and the three together against ``reference.gdn_mixer``, with the bound taken from
the spec's own error against the fp64 oracle (the same composition run in fp64 on fp64 copies) in
the same run. What holds bit for bit is asserted as such: the conv state (a shift of stored values),
and on the interpreter the conv's and the norm's bf16 outputs (0 of the elements below differ;
the conv's fp32 sum is the spec's, so only exp's last bit inside the SiLU is free). The rest is
metamorphic and bit-exact: a row behind a padding row, a row alone against inside a batch, two runs,
fresh rows, sentinel slots in both pools untouched.

The geometry is small and awkward on purpose: 3 value heads per key head, K = 12 (a masked K tail),
V = 40 (two value blocks in the decode kernel, a masked norm tile), conv_dim 288 (two conv blocks,
the second masked).
"""

from __future__ import annotations

import logging

import pytest
import torch
from sm90_compile import compiled_variants

from kernels import reference
from kernels.gdn.base import GDNGeometry, StateRows
from kernels.gdn.decode_mixer import (
    MAX_KEY_DIM,
    DecodeMixer,
    DecodeMixerError,
    MixerWeights,
    check_decode_mixer,
    gdn_decode_mixer,
)
from kernels.triton.gdn_conv_step import SERVING_WIDTHS, GDNConvError, gdn_conv_step
from kernels.triton.gdn_decode import GDNDecodeError, gdn_decode_step, gdn_decode_step_with_gates
from kernels.triton.gdn_gated_norm import (
    MAX_VALUE_DIM,
    SERVING_VALUE_DIMS,
    GDNGatedNormError,
    gdn_gated_norm,
)
from kernels.triton.storage import interpreted

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, WIDTH = 2, 6, 12, 40, 4
GEOMETRY = GDNGeometry(KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM)
CONV_DIM = 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM
VALUE_WIDTH = VALUE_HEADS * VALUE_DIM
EPS = 1e-6
SENTINEL = 7.0
# The kernels' error against the fp64 oracle may be this many times the spec's own. Measured
# 2026-12-05 under the interpreter at this geometry, seeds 1-3: the decode step with gates, outputs
# 0.73-2.1× (bf16 the high end), states 0.77-1.35×; the whole mixer, outputs 0.74-1.5×, recurrent
# states 0.69-1.48×. The kernels round at the spec's points; their sums over K and V run in other
# orders, and exp and log1p may differ in the last fp32 bit.
SPEC_RATIO = 4.0
# fp32 conv outputs: the spec's sum bit for bit, then SiLU, whose exp may differ in its last bit;
# measured at most 3 fp32 ulps apart from the spec (seeds 1-3, 2,000 elements each).
CONV_FP32_ULPS = 4
# fp32 gated norm outputs: the sum of squares in another order (a few ulps of the inverse RMS) and
# the SiLU's exp; measured at most 7 fp32 ulps apart from the spec (64 × 6 × 40 elements).
NORM_FP32_ULPS = 8
# On a GPU, libdevice's exp against the spec's: at most this share of bf16 elements may sit one
# rounding away (the interpreter's figure is 0).
GPU_FLIP_SHARE = 0.01


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in fp32 ulps between two fp32 tensors of one sign pattern."""
    ai = a.float().cpu().view(torch.int32).long()
    bi = b.float().cpu().view(torch.int32).long()
    return int((ai - bi).abs().max())


def _check_bf16_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    differing = int((got != want).sum())
    if interpreted():
        assert differing == 0, f"{differing} of {got.numel()} bf16 elements differ from the spec"
    else:
        assert differing <= GPU_FLIP_SHARE * got.numel(), (differing, got.numel())


def _projected(rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """An input projection's output ``[rows, qkv | z | b | a]`` with two NaN columns past a: the
    kernels read column views of it, and a read past a view would show."""
    gen = torch.Generator().manual_seed(seed)
    width = CONV_DIM + VALUE_WIDTH + 2 * VALUE_HEADS
    buffer = torch.full((rows, width + 2), float("nan"))
    buffer[:, :width] = torch.randn(rows, width, generator=gen)
    buffer[:, CONV_DIM + VALUE_WIDTH :] *= 2  # b and a out to ±6: sigmoid's and softplus' tails
    return buffer.to(dtype).to(DEVICE)


def _split(projected: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """qkv, z, b, a: the model's column views."""
    return tuple(projected[:, :-2].split([CONV_DIM, VALUE_WIDTH, VALUE_HEADS, VALUE_HEADS], dim=-1))


def _weights(dtype: torch.dtype, seed: int, width: int = WIDTH) -> MixerWeights:
    gen = torch.Generator().manual_seed(seed)
    conv = 0.5 * torch.randn(CONV_DIM, width, generator=gen)
    a_log = torch.empty(VALUE_HEADS).uniform_(0.01, 0.3, generator=gen).log()  # fp32, as checkpoints
    dt_bias = torch.empty(VALUE_HEADS).uniform_(0.5, 1.5, generator=gen)
    norm = 1 + 0.1 * torch.randn(VALUE_DIM, generator=gen)  # fp32, as checkpoints
    return MixerWeights(
        conv.to(dtype).to(DEVICE), a_log.to(DEVICE), dt_bias.to(dtype).to(DEVICE), norm.to(DEVICE), EPS
    )


def _pools(
    slots: int, dtype: torch.dtype, seed: int, width: int = WIDTH
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(slots, width - 1, CONV_DIM, generator=gen).to(dtype)
    recurrent = 0.3 * torch.randn(slots, VALUE_HEADS, VALUE_DIM, KEY_DIM, generator=gen)
    return conv.to(DEVICE), recurrent.to(DEVICE)


def _rows(slots: list[int], fresh: list[bool]) -> StateRows:
    return StateRows(torch.tensor(slots, device=DEVICE), torch.tensor(fresh, device=DEVICE))


def _initial(pool: torch.Tensor, rows: StateRows) -> torch.Tensor:
    keep = (~rows.fresh).view(-1, *([1] * (pool.dim() - 1)))
    return torch.where(keep, pool[rows.slots], torch.zeros((), dtype=pool.dtype, device=pool.device))


def _spec_mixer(
    projected: torch.Tensor,
    weights: MixerWeights,
    cu: tuple[int, ...],
    conv_initial: torch.Tensor,
    recurrent_initial: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference.gdn_mixer`` on the operands; ``dtype=torch.float64`` runs the oracle on fp64 copies."""
    qkv, z, b, a = _split(projected)
    w = weights
    tensors = (qkv, z, b, a, w.conv, w.a_log, w.dt_bias, w.norm)
    if dtype is not None:
        tensors = tuple(t.to(dtype) for t in tensors)
        conv_initial, recurrent_initial = conv_initial.to(dtype), recurrent_initial.to(dtype)
    return reference.gdn_mixer(
        *tensors,
        EPS,
        KEY_HEADS,
        cu,
        conv_initial,
        recurrent_initial,
        accumulate=dtype or torch.float32,
    )


# -- the conv step ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=("fp32", "bf16"))
def test_conv_step_is_the_spec_with_its_state_shifted_in_place(dtype: torch.dtype, width: int) -> None:
    x = _split(_projected(7, dtype, seed=1))[0]
    weights = _weights(dtype, seed=2, width=width)
    conv_pool, _ = _pools(10, dtype, seed=3, width=width)
    rows = _rows([3, 1, 6, 4, 2, 8, 7], [False, True, False, False, True, False, False])
    cu = tuple(range(8))
    initial = _initial(conv_pool, rows)
    want_y, want_state = reference.causal_conv1d(x, weights.conv, cu, initial)
    oracle_y, _ = reference.causal_conv1d(
        x.double(), weights.conv.double(), cu, initial.double(), accumulate=torch.float64
    )
    untouched = conv_pool[[0, 5, 9]].clone()
    got = gdn_conv_step(x, weights.conv, rows.slots, rows.fresh, conv_pool)
    assert got.dtype == dtype and got.shape == (7, CONV_DIM)
    # The new state is the spec's bit for bit; slots outside the batch, the padding slot among them,
    # keep theirs.
    assert torch.equal(conv_pool[rows.slots], want_state)
    assert torch.equal(conv_pool[[0, 5, 9]], untouched)
    assert _err(got, oracle_y) <= _err(want_y, oracle_y)
    if dtype == torch.float32:
        assert _ulps(got, want_y) <= CONV_FP32_ULPS
    else:
        _check_bf16_bits(got, want_y)


def test_conv_step_fresh_rows_ignore_what_their_slot_holds() -> None:
    x = _split(_projected(2, torch.bfloat16, seed=4))[0]
    weights = _weights(torch.bfloat16, seed=5)
    rows = _rows([1, 2], [True, True])
    clean = torch.zeros(3, WIDTH - 1, CONV_DIM, dtype=torch.bfloat16, device=DEVICE)
    dirty, _ = _pools(3, torch.bfloat16, seed=6)
    dirty[0] = 0
    first = gdn_conv_step(x, weights.conv, rows.slots, rows.fresh, clean)
    second = gdn_conv_step(x, weights.conv, rows.slots, rows.fresh, dirty)
    assert torch.equal(first, second) and torch.equal(clean, dirty)
    # A fresh row's state is W − 2 zero rows and its token.
    assert torch.equal(clean[1:, -1], x) and not clean[1:, :-1].any()


# -- the gated norm --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=("fp32", "bf16"))
def test_gated_norm_is_the_spec_up_to_its_free_bits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, VALUE_HEADS, VALUE_DIM, generator=gen).to(dtype).to(DEVICE)
    z = _split(_projected(64, dtype, seed=8))[1].view(64, VALUE_HEADS, VALUE_DIM)  # a strided view
    weight = _weights(dtype, seed=9).norm
    want = reference.gated_rms_norm(x, z, weight, EPS).reshape(64, VALUE_WIDTH)
    got = gdn_gated_norm(x, z, weight, EPS)
    assert got.dtype == dtype and got.shape == (64, VALUE_WIDTH) and got.is_contiguous()
    if dtype == torch.float32:
        assert _ulps(got, want) <= NORM_FP32_ULPS
    else:
        _check_bf16_bits(got, want)


def test_gated_norm_rows_are_the_same_bits_alone_at_an_offset_and_twice() -> None:
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(5, VALUE_HEADS, VALUE_DIM, generator=gen).bfloat16().to(DEVICE)
    z = torch.randn(5, VALUE_HEADS, VALUE_DIM, generator=gen).bfloat16().to(DEVICE)
    weight = _weights(torch.bfloat16, seed=11).norm
    batch = gdn_gated_norm(x, z, weight, EPS)
    assert torch.equal(gdn_gated_norm(x[3:4], z[3:4], weight, EPS)[0], batch[3])
    shifted = gdn_gated_norm(torch.cat([x[:1] * 0, x]), torch.cat([z[:1], z]), weight, EPS)
    assert torch.equal(shifted[1:], batch)
    assert torch.equal(gdn_gated_norm(x, z, weight, EPS), batch)


# -- the decode step with the gates in its prologue ------------------------------------------------


def _decode_step_case(
    dtype: torch.dtype,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    MixerWeights,
    torch.Tensor,
    StateRows,
]:
    """q, k, v, the projection's b and a, a layer's weights, a state pool of 8 slots and 5 rows
    (two fresh) in it: one decode step's inputs."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(5, KEY_HEADS, KEY_DIM, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(5, KEY_HEADS, KEY_DIM, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(5, VALUE_HEADS, VALUE_DIM, generator=gen).to(dtype).to(DEVICE)
    _, _, b, a = _split(_projected(5, dtype, seed=13))
    weights = _weights(dtype, seed=14)
    _, pool = _pools(8, dtype, seed=15)
    rows = _rows([3, 1, 6, 4, 2], [False, True, False, False, True])
    return q, k, v, b, a, weights, pool, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=("fp32", "bf16"))
def test_decode_step_with_gates_is_gates_then_the_delta_rule(dtype: torch.dtype) -> None:
    q, k, v, b, a, weights, pool, rows = _decode_step_case(dtype)
    initial = _initial(pool, rows)
    cu = tuple(range(6))
    d = torch.float64
    g64, beta64 = reference.gdn_gates(a.to(d), b.to(d), weights.a_log.to(d), weights.dt_bias.to(d))
    want_o, want_s = reference.gated_delta_rule(
        q.to(d), k.to(d), v.to(d), g64, beta64, cu, initial.to(d), accumulate=d
    )
    g, beta = reference.gdn_gates(a, b, weights.a_log, weights.dt_bias)
    spec_o, spec_s = reference.gated_delta_rule(q, k, v, g, beta, cu, initial)
    untouched = pool[[0, 5, 7]].clone()
    got = gdn_decode_step_with_gates(
        q, k, v, a, b, weights.a_log, weights.dt_bias, rows.slots, rows.fresh, pool
    )
    assert got.dtype == dtype and got.shape == (5, VALUE_HEADS, VALUE_DIM)
    assert _err(got, want_o) <= SPEC_RATIO * _err(spec_o, want_o)
    assert _err(pool[rows.slots], want_s) <= SPEC_RATIO * _err(spec_s, want_s)
    assert torch.equal(pool[[0, 5, 7]], untouched), "a slot outside the batch was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=("fp32", "bf16"))
def test_gates_in_the_prologue_are_the_spec_gates_fed_to_the_decode_step(dtype: torch.dtype) -> None:
    """The fused step against ``gdn_decode_step`` given ``reference.gdn_gates``' g and β: the only
    freedom is g's last fp32 bits (exp, log1p, exp), so the bound is how far the decode step moves
    when g moves by 4 fp32 ulps either way, measured here. β is rounded to b's dtype by both: a β left
    unrounded moves bf16 outputs by ~1e-3, far past it. Measured: fp32 0.75× the spread; bf16 the
    same bits (the spread on outputs is 0 there)."""
    q, k, v, b, a, weights, pool, rows = _decode_step_case(dtype)
    g, beta = reference.gdn_gates(a, b, weights.a_log, weights.dt_bias)
    composed_pool = pool.clone()
    composed = gdn_decode_step(q, k, v, g, beta, rows.slots, rows.fresh, composed_pool)
    spread_out = spread_state = 0.0
    for factor in (1 - 2.0**-21, 1 + 2.0**-21):
        moved_pool = pool.clone()
        moved = gdn_decode_step(q, k, v, g * factor, beta, rows.slots, rows.fresh, moved_pool)
        spread_out = max(spread_out, _err(moved, composed))
        spread_state = max(spread_state, _err(moved_pool, composed_pool))
    assert spread_state > 0, "moving g moved no state: the bound would be zero"
    got = gdn_decode_step_with_gates(
        q, k, v, a, b, weights.a_log, weights.dt_bias, rows.slots, rows.fresh, pool
    )
    assert _err(got, composed) <= spread_out
    assert _err(pool, composed_pool) <= spread_state


# -- the three together ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=("fp32", "bf16"))
def test_mixer_is_the_spec_composition(dtype: torch.dtype) -> None:
    projected = _projected(5, dtype, seed=16)
    weights = _weights(dtype, seed=17)
    conv_pool, recurrent_pool = _pools(8, dtype, seed=18)
    rows = _rows([3, 1, 6, 4, 2], [False, True, False, False, True])
    cu = tuple(range(6))
    conv_initial, recurrent_initial = _initial(conv_pool, rows), _initial(recurrent_pool, rows)
    want = _spec_mixer(projected, weights, cu, conv_initial, recurrent_initial, torch.float64)
    spec = _spec_mixer(projected, weights, cu, conv_initial, recurrent_initial)
    untouched = conv_pool[[0, 5, 7]].clone(), recurrent_pool[[0, 5, 7]].clone()
    qkv, z, b, a = _split(projected)
    got = gdn_decode_mixer(qkv, z, b, a, weights, GEOMETRY, rows, conv_pool, recurrent_pool)
    assert got.dtype == dtype and got.shape == (5, VALUE_WIDTH)
    assert _err(got, want[0]) <= SPEC_RATIO * _err(spec[0], want[0])
    assert torch.equal(conv_pool[rows.slots], spec[1])
    assert _err(recurrent_pool[rows.slots], want[2]) <= SPEC_RATIO * _err(spec[2], want[2])
    assert torch.equal(conv_pool[[0, 5, 7]], untouched[0])
    assert torch.equal(recurrent_pool[[0, 5, 7]], untouched[1])


def test_three_decode_steps_end_in_the_spec_states_of_the_three_token_sequences() -> None:
    """Three mixer steps from each row's slot equal the spec over the three tokens as one sequence:
    the conv state after three shifts bit for bit, the outputs and recurrent state within the bound."""
    dtype = torch.float32
    tokens = 3
    steps = [_projected(4, dtype, seed=20 + t) for t in range(tokens)]
    weights = _weights(dtype, seed=19)
    conv_pool, recurrent_pool = _pools(6, dtype, seed=23)
    rows = _rows([2, 5, 1, 4], [False, True, False, True])
    conv_initial, recurrent_initial = _initial(conv_pool, rows), _initial(recurrent_pool, rows)
    # The spec's packed batch: sequence n holds its row of every step, in step order.
    packed = torch.stack(steps, dim=1).reshape(4 * tokens, -1)
    cu = tuple(range(0, 4 * tokens + 1, tokens))
    want = _spec_mixer(packed, weights, cu, conv_initial, recurrent_initial, torch.float64)
    spec = _spec_mixer(packed, weights, cu, conv_initial, recurrent_initial)
    outs = []
    for t, projected in enumerate(steps):
        step_rows = rows if t == 0 else StateRows(rows.slots, torch.zeros_like(rows.fresh))
        outs.append(
            gdn_decode_mixer(*_split(projected), weights, GEOMETRY, step_rows, conv_pool, recurrent_pool)
        )
    got = torch.stack(outs, dim=1).reshape(4 * tokens, -1)
    assert _err(got, want[0]) <= SPEC_RATIO * _err(spec[0], want[0])
    assert torch.equal(conv_pool[rows.slots], spec[1])
    assert _err(recurrent_pool[rows.slots], want[2]) <= SPEC_RATIO * _err(spec[2], want[2])


def _mix(projected: torch.Tensor, rows: StateRows, pools: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return gdn_decode_mixer(*_split(projected), _weights(torch.bfloat16, seed=30), GEOMETRY, rows, *pools)


def _sentinel_pools() -> tuple[torch.Tensor, torch.Tensor]:
    conv, recurrent = _pools(8, torch.bfloat16, seed=31)
    for slot in (6, 7):
        conv[slot] = SENTINEL
        recurrent[slot] = SENTINEL
    return conv, recurrent


def test_a_padding_row_in_front_changes_no_bit_and_touches_no_other_slot() -> None:
    """The same rows behind a CUDA-graph filler row (slot 0, fresh) give the same bits; slots outside
    the batch keep their sentinels; only the padding slot 0 differs between the two runs."""
    projected = _projected(4, torch.bfloat16, seed=32)
    slots, fresh = [2, 5, 3, 1], [False, False, True, False]
    plain, shifted = _sentinel_pools(), _sentinel_pools()
    base = tuple(p.clone() for p in plain)
    out0 = _mix(projected, _rows(slots, fresh), plain)
    filler = torch.cat([projected[:1] * 0, projected])
    out1 = _mix(filler, _rows([0, *slots], [True, *fresh]), shifted)
    assert torch.equal(out1[1:], out0)
    for got, want, before in zip(shifted, plain, base, strict=True):
        assert torch.equal(got[1:], want[1:])
        assert torch.equal(want[0], before[0]), "the padding slot was written by a batch without it"
        assert torch.equal(want[6:], torch.full_like(want[6:], SENTINEL))
        assert not torch.equal(want[2], before[2]), "the batch's slots were not written"


def test_a_row_alone_is_the_row_inside_a_batch_and_two_runs_agree() -> None:
    projected = _projected(6, torch.bfloat16, seed=33)
    slots, fresh = [1, 2, 3, 4, 5, 6], [False, True, False, False, False, True]
    batch_pools, alone_pools, again_pools = (
        _pools(8, torch.bfloat16, 34),
        _pools(8, torch.bfloat16, 34),
        _pools(8, torch.bfloat16, 34),
    )
    batch = _mix(projected, _rows(slots, fresh), batch_pools)
    row = 3
    alone = _mix(projected[row : row + 1], _rows(slots[row : row + 1], fresh[row : row + 1]), alone_pools)
    assert torch.equal(alone[0], batch[row])
    for a, b in zip(alone_pools, batch_pools, strict=True):
        assert torch.equal(a[slots[row]], b[slots[row]])
    assert torch.equal(_mix(projected, _rows(slots, fresh), again_pools), batch)
    for a, b in zip(again_pools, batch_pools, strict=True):
        assert torch.equal(a, b)


# -- dispatch and refusals -------------------------------------------------------------------------


def test_dispatch_runs_decode_steps_and_logs_each_reason_to_compose_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mixer = DecodeMixer(GEOMETRY, WIDTH, torch.bfloat16)
    decode = _rows([1, 2], [False, False])
    prefill = StateRows(decode.slots, decode.fresh, (0, 3, 4))
    assert mixer.refused is None and mixer.runs(decode, DEVICE)
    with caplog.at_level(logging.INFO, logger="infer.kernels.gdn"):
        assert not mixer.runs(prefill, DEVICE) and not mixer.runs(prefill, DEVICE)
        refused = DecodeMixer(GEOMETRY, 5, torch.bfloat16)
        assert not refused.runs(decode, DEVICE) and not refused.runs(decode, DEVICE)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("prefill row" in m for m in messages) == 1, messages
    assert sum("conv width 5" in m for m in messages) == 1, messages


def test_refusals_name_the_value() -> None:
    with pytest.raises(GDNConvError, match="conv width 5"):
        check_decode_mixer(GEOMETRY, 5, torch.bfloat16)
    with pytest.raises(GDNConvError, match="conv width 1"):
        check_decode_mixer(GEOMETRY, 1, torch.bfloat16)
    with pytest.raises(GDNConvError, match=r"conv dtype torch\.float64"):
        check_decode_mixer(GEOMETRY, WIDTH, torch.float64)
    with pytest.raises(GDNGatedNormError, match=f"value head dim {2 * MAX_VALUE_DIM}"):
        check_decode_mixer(GDNGeometry(2, 2, 16, 2 * MAX_VALUE_DIM), WIDTH, torch.bfloat16)
    with pytest.raises(DecodeMixerError, match=f"key head dim {2 * MAX_KEY_DIM}"):
        check_decode_mixer(GDNGeometry(2, 2, 2 * MAX_KEY_DIM, 16), WIDTH, torch.bfloat16)

    projected = _projected(2, torch.bfloat16, seed=40)
    qkv, z, b, a = _split(projected)
    weights = _weights(torch.bfloat16, seed=41)
    conv_pool, recurrent_pool = _pools(3, torch.bfloat16, seed=42)
    rows = _rows([1, 2], [False, False])
    with pytest.raises(DecodeMixerError, match=r"one token per row, got cu_seqlens \(0, 1, 2\)"):
        gdn_decode_mixer(
            qkv,
            z,
            b,
            a,
            weights,
            GEOMETRY,
            StateRows(rows.slots, rows.fresh, (0, 1, 2)),
            conv_pool,
            recurrent_pool,
        )
    with pytest.raises(GDNConvError, match=r"conv_pool is torch\.float32, x torch\.bfloat16"):
        gdn_conv_step(qkv, weights.conv, rows.slots, rows.fresh, conv_pool.float())
    with pytest.raises(GDNConvError, match=r"conv_pool must be \[slots, 3, 288\]"):
        gdn_conv_step(qkv, weights.conv, rows.slots, rows.fresh, conv_pool[:, :2])
    with pytest.raises(GDNConvError, match="slots must be int64"):
        gdn_conv_step(qkv, weights.conv, rows.slots.int(), rows.fresh, conv_pool)
    q = qkv[:, : KEY_HEADS * KEY_DIM].reshape(2, KEY_HEADS, KEY_DIM)
    v = qkv[:, 2 * KEY_HEADS * KEY_DIM :].reshape(2, VALUE_HEADS, VALUE_DIM)
    with pytest.raises(GDNDecodeError, match=r"a_log must be \[6\]"):
        gdn_decode_step_with_gates(
            q, q, v, a, b, weights.a_log[:2], weights.dt_bias, rows.slots, rows.fresh, recurrent_pool
        )
    with pytest.raises(GDNDecodeError, match=r"b must be bf16, fp16 or fp32, got torch\.int32"):
        gdn_decode_step_with_gates(
            q, q, v, a, b.int(), weights.a_log, weights.dt_bias, rows.slots, rows.fresh, recurrent_pool
        )
    x = v.contiguous()
    with pytest.raises(GDNGatedNormError, match=r"gate must be \[2, 6, 40\]"):
        gdn_gated_norm(x, x[:, :2], weights.norm, EPS)
    with pytest.raises(GDNGatedNormError, match=r"weight must be \[40\]"):
        gdn_gated_norm(x, x, weights.norm[:8], EPS)


def test_every_variant_compiles_for_sm90() -> None:
    assert len(compiled_variants("kernels.triton.gdn_conv_step")) == len(SERVING_WIDTHS)
    assert len(compiled_variants("kernels.triton.gdn_gated_norm")) == len(SERVING_VALUE_DIMS)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_serving_geometry_on_the_gpu_matches_the_spec_and_replays_from_a_graph() -> None:
    """The 4B geometry (Hk 16, Hv 32, K = V = 128, W = 4) at a bucket of 64 rows, bf16, the last 8
    filler rows (slot 0, fresh) as a CUDA-graph bucket pads: within the spec bound, and a graph
    replay of the step (the bucket's static inputs, no host sync) equal to the eager call."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    n, live, hk, hv, dim, width = 64, 56, 16, 32, 128, 4
    geometry = GDNGeometry(hk, hv, dim, dim)
    channels, values = 2 * hk * dim + hv * dim, hv * dim
    projected = torch.randn(n, channels + values + 2 * hv, generator=gen, device=device).bfloat16()
    qkv, z, b, a = projected.split([channels, values, hv, hv], dim=-1)
    weights = MixerWeights(
        (0.5 * torch.randn(channels, width, generator=gen, device=device)).bfloat16(),
        torch.empty(hv, device=device).uniform_(0.01, 0.3, generator=gen).log(),
        torch.empty(hv, device=device).uniform_(0.5, 1.5, generator=gen).bfloat16(),
        1 + 0.1 * torch.randn(dim, generator=gen, device=device),
        EPS,
    )
    slots = torch.cat(
        [
            torch.randperm(live, generator=gen, device=device) + 1,
            torch.zeros(n - live, device=device, dtype=torch.long),
        ]
    )
    fresh = torch.cat(
        [
            torch.rand(live, generator=gen, device=device) < 0.25,
            torch.ones(n - live, dtype=torch.bool, device=device),
        ]
    )
    rows = StateRows(slots, fresh)
    conv_base = torch.randn(live + 1, width - 1, channels, generator=gen, device=device).bfloat16()
    recurrent_base = 0.3 * torch.randn(live + 1, hv, dim, dim, generator=gen, device=device)
    keep = slice(0, live)
    cu = tuple(range(live + 1))
    conv_initial = torch.where(
        fresh[keep, None, None], torch.zeros((), dtype=torch.bfloat16, device=device), conv_base[slots[keep]]
    )
    recurrent_initial = torch.where(fresh[keep, None, None, None], 0.0, recurrent_base[slots[keep]])
    operands = (
        qkv[keep],
        z[keep],
        b[keep],
        a[keep],
        weights.conv,
        weights.a_log,
        weights.dt_bias,
        weights.norm,
    )
    d = torch.float64
    want = reference.gdn_mixer(
        *(t.to(d) for t in operands), EPS, hk, cu, conv_initial.to(d), recurrent_initial.to(d), accumulate=d
    )
    spec = reference.gdn_mixer(*operands, EPS, hk, cu, conv_initial, recurrent_initial)
    conv_pool, recurrent_pool = conv_base.clone(), recurrent_base.clone()
    out = gdn_decode_mixer(qkv, z, b, a, weights, geometry, rows, conv_pool, recurrent_pool)
    live_slots = slots[keep]
    assert _err(out[keep], want[0]) <= SPEC_RATIO * _err(spec[0], want[0])
    assert torch.equal(conv_pool[live_slots], spec[1])
    assert _err(recurrent_pool[live_slots], want[2]) <= SPEC_RATIO * _err(spec[2], want[2])
    row = 17
    alone = conv_base.clone(), recurrent_base.clone()
    one = gdn_decode_mixer(
        qkv[row : row + 1], z[row : row + 1], b[row : row + 1], a[row : row + 1], weights, geometry,
        StateRows(slots[row : row + 1], fresh[row : row + 1]), *alone,
    )  # fmt: skip
    assert torch.equal(one[0], out[row])
    graphed = conv_base.clone(), recurrent_base.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = gdn_decode_mixer(qkv, z, b, a, weights, geometry, rows, *graphed)
    graphed[0].copy_(conv_base)
    graphed[1].copy_(recurrent_base)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed[keep], out[keep])
    assert torch.equal(graphed[0][1:], conv_pool[1:]) and torch.equal(graphed[1][1:], recurrent_pool[1:])
