"""The GDN gates kernel (kernels/triton/gdn_gates.py) against ``reference.gdn_gates`` and itself.

Runs on the GPU when there is one, otherwise under Triton's interpreter (tests/kernels/conftest.py).
The inputs are column views of an input projection's output with NaN columns past them (a read past
a view would show), a and b out to ±6 (softplus' and sigmoid's tails), A_log in fp32 as checkpoints
store it. The spec's β is rounded to b's dtype as the kernel's is; g's freedom is the last bits of
exp and log1p, bounded by the spec's own error against fp64 as measured below. The rest is bit-exact: a token alone against
inside a batch, two runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sm90_compile import compiled_variants

from kernels import reference
from kernels.triton.gdn_gates import SERVING_HEADS, GDNGatesError, gdn_gates
from kernels.triton.storage import interpreted

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS = 6  # a masked head tile (8 wide)
# g's and β's error against the gates in fp64 may be this many times the spec's own (its fp32 ops
# against fp64). The free parts are the last bits of exp and log1p (the interpreter's log1p is a
# few-ulp form, kernels/triton/gdn_decode.py). Measured under the interpreter, 2026-12-05, seeds
# 1-20, 40 × 6 gates each: g 0.78-1.88 (fp32), 1.30-2.80 (bf16), 1.36-2.40 (fp16); fp32 β within 2
# ulps of the spec's.
SPEC_RATIO = 4.0
# bf16 / fp16 β: rounded to b's dtype by both; on the interpreter no element differed (measured as
# above); on a GPU (libdevice against torch's kernels) at most this share may sit one rounding away.
GPU_FLIP_SHARE = 0.01


def _relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float(((got.double().cpu() - exact) / exact).abs().max())


def _case(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    projected = torch.full((tokens, 5 + 2 * HEADS + 2), float("nan"))
    projected[:, 5 : 5 + 2 * HEADS] = 3 * torch.randn(tokens, 2 * HEADS, generator=gen)
    projected = projected.to(dtype).to(DEVICE)
    b, a = projected[:, 5 : 5 + HEADS], projected[:, 5 + HEADS : 5 + 2 * HEADS]
    a_log = torch.empty(HEADS).uniform_(0.01, 16.0, generator=gen).log().to(DEVICE)
    dt_bias = torch.randn(HEADS, generator=gen).to(dtype).to(DEVICE)
    return a, b, a_log, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gates_are_the_spec_gates(dtype: torch.dtype, seed: int) -> None:
    a, b, a_log, dt_bias = _case(40, dtype, seed)
    want_g, want_beta = reference.gdn_gates(a, b, a_log, dt_bias)
    exact_g = -a_log.double().cpu().exp() * F.softplus(a.double().cpu() + dt_bias.double().cpu())
    exact_beta = torch.sigmoid(b.double().cpu())
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert g.is_contiguous() and beta.is_contiguous()
    assert not g.isnan().any() and not beta.isnan().any(), "a read past the a / b views"
    assert _relative(g, exact_g) <= SPEC_RATIO * _relative(want_g, exact_g)
    if dtype == torch.float32:
        assert _relative(beta, exact_beta) <= SPEC_RATIO * _relative(want_beta, exact_beta)
        return
    differing = int((beta != want_beta).sum())
    if interpreted():
        assert differing == 0, f"{differing} of {beta.numel()} β differ from the spec"
    else:
        assert differing <= GPU_FLIP_SHARE * beta.numel(), (differing, beta.numel())


def test_a_token_has_the_same_gates_alone_as_in_a_batch_and_run_twice() -> None:
    a, b, a_log, dt_bias = _case(37, torch.bfloat16, seed=4)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    again = gdn_gates(a, b, a_log, dt_bias)
    assert torch.equal(g, again[0]) and torch.equal(beta, again[1])
    for token in (0, 17, 36):  # first, inside the second program, the last (masked) program's
        alone = gdn_gates(a[token : token + 1], b[token : token + 1], a_log, dt_bias)
        assert torch.equal(alone[0][0], g[token]) and torch.equal(alone[1][0], beta[token])


def test_no_tokens_gives_empty_gates() -> None:
    a, b, a_log, dt_bias = _case(3, torch.bfloat16, seed=5)
    g, beta = gdn_gates(a[:0], b[:0], a_log, dt_bias)
    assert g.shape == (0, HEADS) and beta.shape == (0, HEADS)


def test_inputs_it_cannot_take_are_named() -> None:
    a, b, a_log, dt_bias = _case(3, torch.bfloat16, seed=6)
    with pytest.raises(GDNGatesError, match=r"a and b must both be \[T, Hv\]"):
        gdn_gates(a, b[:, :-1], a_log, dt_bias)
    with pytest.raises(GDNGatesError, match=r"dt_bias must be \[6\]"):
        gdn_gates(a, b, a_log, dt_bias[:-1])
    with pytest.raises(GDNGatesError, match="a_log must be bf16, fp16 or fp32"):
        gdn_gates(a, b, a_log.double(), dt_bias)


def test_every_variant_compiles_for_sm90() -> None:
    assert len(compiled_variants("kernels.triton.gdn_gates")) == len(SERVING_HEADS)
