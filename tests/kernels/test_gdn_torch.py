"""The torch GDN backend against the spec (kernels/reference.py), on varlen batches.

Tolerances are measured in the same run: the spec itself run in fp64 (`accumulate=torch.float64`
on fp64 inputs) is the oracle; the spec's own fp32 error against it sets the bound a fast form is
held to. The chunked form reorders sums inside a 64-token chunk and solves a triangular system,
so it may be `CHUNK_RATIO` times the spec's error. Measured at the varlen batch below
(2026-12-03, chunk 64, the worst of with and without initial state): mild decay (A in U(0.01, 0.3))
4.8× on the outputs, 10× on the final states (spec 4.9e-8 / 1.5e-7); strong decay (A in U(1, 16),
the synthetic checkpoints' range) 11× and 48× (spec 4.0e-8 / 9.2e-8). That it is rounding and
nothing else is checked directly: the same chunked algebra run in fp64 meets the fp64 spec to
4.4e-16 (`FP64_ALGEBRA` below leaves 2000×).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.gdn import GDNBackendError, StateRows, TorchGDN, pick_gdn_backend
from kernels.reference import SpecError

# The chunked form's fp32 error may be this many times the spec's own (module doc: ≤ 48× measured).
CHUNK_RATIO = 64
# The chunked algebra in fp64 against the fp64 spec (module doc: 4.4e-16 measured).
FP64_ALGEBRA = 1e-12
# A per value head: mild decay keeps the initial state alive across a whole sequence, strong decay
# forgets it within a few tokens.
DECAYS = {"mild": (0.01, 0.3), "strong": (1.0, 16.0)}
LENGTHS = (1, 2, 63, 64, 65, 127, 128)
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 16, 8


def _bounds(lengths: tuple[int, ...]) -> tuple[int, ...]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def _inputs(tokens: int, seed: int, decay: str = "mild") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, KEY_HEADS, KEY_DIM, generator=gen)
    k = torch.randn(tokens, KEY_HEADS, KEY_DIM, generator=gen)
    v = torch.randn(tokens, VALUE_HEADS, VALUE_DIM, generator=gen)
    a = torch.randn(tokens, VALUE_HEADS, generator=gen)
    b = torch.randn(tokens, VALUE_HEADS, generator=gen)
    a_log = torch.empty(VALUE_HEADS).uniform_(*DECAYS[decay], generator=gen).log()
    dt_bias = torch.empty(VALUE_HEADS).uniform_(0.5, 1.5, generator=gen)
    g, beta = reference.gdn_gates(a, b, a_log, dt_bias)
    return q, k, v, g, beta


def _states(sequences: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 0.3 * torch.randn(sequences, VALUE_HEADS, VALUE_DIM, KEY_DIM, generator=gen)


def _oracle(q, k, v, g, beta, cu, initial):  # type: ignore[no-untyped-def]
    d = torch.float64
    return reference.gated_delta_rule(
        q.to(d),
        k.to(d),
        v.to(d),
        g.to(d),
        beta.to(d),
        cu,
        None if initial is None else initial.to(d),
        accumulate=d,
    )


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


def _pool_with(initial: torch.Tensor | None, sequences: int, extra: int = 2) -> torch.Tensor:
    """A pool whose slots 1..N hold the initial states; slot 0 and `extra` more hold sentinels."""
    pool = torch.full((sequences + 1 + extra, VALUE_HEADS, VALUE_DIM, KEY_DIM), 7.0)
    if initial is not None:
        pool[1 : sequences + 1] = initial
    return pool


def _rows(sequences: int, cu: tuple[int, ...] | None, fresh: bool) -> StateRows:
    return StateRows(torch.arange(1, sequences + 1), torch.full((sequences,), fresh, dtype=torch.bool), cu)


def test_one_token_from_zero_state_is_the_closed_form() -> None:
    """Anchor: from S = 0, one token writes S = β·v⊗k̂ and reads o = β·v·(k̂·q̂)."""
    q, k, v, g, beta = _inputs(1, seed=1)
    o, state = reference.gated_delta_rule(q, k, v, g, beta, (0, 1))
    group = VALUE_HEADS // KEY_HEADS
    kh = reference.l2_normalize(k)[0].repeat_interleave(group, 0)
    qh = reference.l2_normalize(q)[0].repeat_interleave(group, 0) * KEY_DIM**-0.5
    want_state = beta[0][:, None, None] * v[0][:, :, None] * kh[:, None, :]
    want_o = beta[0][:, None] * v[0] * (kh * qh).sum(-1)[:, None]
    torch.testing.assert_close(state[0], want_state, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(o[0], want_o, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("decay", sorted(DECAYS))
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_matches_spec_on_varlen_batches(with_initial: bool, chunk_size: int, decay: str) -> None:
    cu = _bounds(LENGTHS)
    q, k, v, g, beta = _inputs(cu[-1], seed=2, decay=decay)
    initial = _states(len(LENGTHS), seed=3) if with_initial else None
    want_o, want_state = _oracle(q, k, v, g, beta, cu, initial)
    spec_o, spec_state = reference.gated_delta_rule(q, k, v, g, beta, cu, initial)
    pool = _pool_with(initial, len(LENGTHS))
    untouched = pool[len(LENGTHS) + 1 :].clone()
    got_o = TorchGDN(chunk_size).delta_rule(q, k, v, g, beta, _rows(len(LENGTHS), cu, not with_initial), pool)
    got_state = pool[1 : len(LENGTHS) + 1]
    spec_err_o, spec_err_s = _max_err(spec_o, want_o), _max_err(spec_state, want_state)
    assert _max_err(got_o, want_o) <= CHUNK_RATIO * spec_err_o, (_max_err(got_o, want_o), spec_err_o)
    assert _max_err(got_state, want_state) <= CHUNK_RATIO * spec_err_s, (
        _max_err(got_state, want_state),
        spec_err_s,
    )
    assert torch.equal(pool[len(LENGTHS) + 1 :], untouched), "a slot outside the batch was written"
    pool64 = _pool_with(initial, len(LENGTHS)).double()
    exact_o = TorchGDN(chunk_size, torch.float64).delta_rule(
        q.double(),
        k.double(),
        v.double(),
        g.double(),
        beta.double(),
        _rows(len(LENGTHS), cu, not with_initial),
        pool64,
    )
    assert _max_err(exact_o, want_o) <= FP64_ALGEBRA
    assert _max_err(pool64[1 : len(LENGTHS) + 1], want_state) <= FP64_ALGEBRA


def test_the_initial_state_is_read() -> None:
    """The varlen gate above would pass vacuously if the initial state never mattered."""
    cu = _bounds(LENGTHS)
    q, k, v, g, beta = _inputs(cu[-1], seed=2)
    cold, _ = reference.gated_delta_rule(q, k, v, g, beta, cu)
    warm, _ = reference.gated_delta_rule(q, k, v, g, beta, cu, _states(len(LENGTHS), seed=3))
    firsts = list(cu[:-1])  # every sequence's first token reads its initial state
    assert float((cold[firsts] - warm[firsts]).abs().min()) > 0.0
    assert float((cold[firsts] - warm[firsts]).abs().max()) > 1e-2


@pytest.mark.parametrize("split", [1, 7, 63, 64, 65, 100])
def test_state_carries_across_a_chunk_boundary_anywhere(split: int) -> None:
    """Prefill of 130 tokens in two pieces (the second reading the state the first wrote) is the
    whole prefill, within the bound the spec's own error sets."""
    length = 130
    q, k, v, g, beta = _inputs(length, seed=4)
    want_o, want_state = _oracle(q, k, v, g, beta, (0, length), None)
    spec_o, spec_state = reference.gated_delta_rule(q, k, v, g, beta, (0, length))
    backend = TorchGDN()
    pool = _pool_with(None, 1)
    first = backend.delta_rule(
        q[:split], k[:split], v[:split], g[:split], beta[:split], _rows(1, (0, split), True), pool
    )
    rest = length - split
    second = backend.delta_rule(
        q[split:], k[split:], v[split:], g[split:], beta[split:], _rows(1, (0, rest), False), pool
    )
    got = torch.cat([first, second])
    assert _max_err(got, want_o) <= CHUNK_RATIO * _max_err(spec_o, want_o)
    assert _max_err(pool[1:2], want_state) <= CHUNK_RATIO * _max_err(spec_state, want_state)


def test_decode_step_is_the_spec_recurrence() -> None:
    """A decode step (one token per sequence, no host boundaries) is one step of the spec."""
    sequences = 5
    q, k, v, g, beta = _inputs(sequences, seed=5)
    initial = _states(sequences, seed=6)
    want_o, want_state = _oracle(q, k, v, g, beta, tuple(range(sequences + 1)), initial)
    spec_o, spec_state = reference.gated_delta_rule(q, k, v, g, beta, tuple(range(sequences + 1)), initial)
    pool = _pool_with(initial, sequences)
    got = TorchGDN().delta_rule(q, k, v, g, beta, _rows(sequences, None, False), pool)
    # The same products and sums as the spec, so within the spec's own error (times 2: either may
    # sit on the other side of the oracle).
    assert _max_err(got, want_o) <= 2 * _max_err(spec_o, want_o)
    assert _max_err(pool[1 : sequences + 1], want_state) <= 2 * _max_err(spec_state, want_state)


def test_fresh_sequences_ignore_what_their_slot_holds() -> None:
    cu = _bounds((3, 5))
    q, k, v, g, beta = _inputs(cu[-1], seed=7)
    clean = _pool_with(torch.zeros(2, VALUE_HEADS, VALUE_DIM, KEY_DIM), 2)
    dirty = _pool_with(_states(2, seed=8), 2)
    a = TorchGDN().delta_rule(q, k, v, g, beta, _rows(2, cu, True), clean)
    b = TorchGDN().delta_rule(q, k, v, g, beta, _rows(2, cu, True), dirty)
    assert torch.equal(a, b) and torch.equal(clean, dirty)


@pytest.mark.parametrize("decode", [False, True])
def test_conv_matches_spec_and_keeps_the_last_inputs(decode: bool) -> None:
    lengths = (1,) * 4 if decode else (1, 2, 3, 5, 64)
    cu = _bounds(lengths)
    gen = torch.Generator().manual_seed(9)
    channels, width = 24, 4
    x = torch.randn(cu[-1], channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    initial = torch.randn(len(lengths), width - 1, channels, generator=gen)
    want, want_state = reference.causal_conv1d(
        x.double(), weight.double(), cu, initial.double(), accumulate=torch.float64
    )
    spec, spec_state = reference.causal_conv1d(x, weight, cu, initial)
    pool = torch.full((len(lengths) + 2, width - 1, channels), 5.0)
    pool[1 : len(lengths) + 1] = initial
    rows = _rows(len(lengths), None if decode else cu, False)
    got = TorchGDN().conv(x, weight, rows, pool)
    # Both round a W-term fp32 sum and then its SiLU: within twice the spec's own error.
    assert _max_err(got, want) <= 2 * _max_err(spec, want)
    # The state is raw inputs, copied: exact. A sequence shorter than W - 1 keeps some history.
    assert torch.equal(pool[1 : len(lengths) + 1], spec_state) and torch.equal(spec_state, want_state.float())
    assert torch.equal(pool[1, :2], initial[0, 1:]) and torch.equal(pool[1, 2], x[0])
    assert torch.equal(pool[-1], torch.full((width - 1, channels), 5.0)), (
        "a slot outside the batch was written"
    )


def test_gated_norm_anchor() -> None:
    """A row of equal values c normalises to c/sqrt(c² + eps); the gate multiplies by silu(gate)."""
    x = torch.full((1, 8), 3.0)
    gate = torch.full((1, 8), 2.0)
    weight = torch.full((8,), 0.5)
    got = reference.gated_rms_norm(x, gate, weight, eps=1e-6)
    want = 3.0 / (9.0 + 1e-6) ** 0.5 * 0.5 * 2.0 / (1.0 + torch.exp(torch.tensor(-2.0)))
    torch.testing.assert_close(got, torch.full((1, 8), float(want)), rtol=1e-6, atol=0.0)


def test_spec_refuses_shapes_it_does_not_define() -> None:
    q, k, v, g, beta = _inputs(4, seed=10)
    with pytest.raises(SpecError, match="value heads are not a multiple"):
        reference.gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], (0, 4))
    with pytest.raises(SpecError, match="cu_seqlens"):
        reference.gated_delta_rule(q, k, v, g, beta, (0, 3))


def test_backend_choice_on_cpu_is_torch_and_refuses_the_gpu_backends_by_name() -> None:
    cpu = torch.device("cpu")
    assert pick_gdn_backend("torch", cpu).name == "torch"
    assert pick_gdn_backend("auto", cpu).name == "torch"
    for name in ("fla", "flashinfer"):
        with pytest.raises(GDNBackendError, match=f"--gdn-backend '{name}' is not available on CPU"):
            pick_gdn_backend(name, cpu)
    with pytest.raises(GDNBackendError, match="unknown"):
        pick_gdn_backend("triton", cpu)
