"""The Triton RMSNorm and fused residual step + RMSNorm against the spec, bit for bit, under the
interpreter (on the GPU when there is one), plus an sm_90 compile check of every variant.

The spec (``kernels.reference.rms_norm``) leaves kernels one freedom: the order of the fp32 sum of
squares. In bf16 that never shows at these seeds, so random inputs are compared bit for bit. In fp32
it does (an ulp of 1/rms moves most of a row), so the bit-for-bit fp32 cases use inputs on a 1/8
grid whose squares and sums are exact in any order; every other rounding point is still exercised.

One more gap, in the reference rather than the kernel: the spec's ``1 / sqrt(...)`` is IEEE, but
torch's CPU fp32 ``sqrt`` (2.13, this build) is not correctly rounded for about a fifth of inputs.
That ulp of 1/rms shows in fp32 outputs, so fp32 rows whose reference sqrt missed are held to a
tolerance and every other row to the bit (the test checks that most rows are of the second kind).
On the GPU the spec is still evaluated on the host: torch's CUDA mean multiplies by a rounded 1/n,
an ulp off the spec at widths that are not powers of two (``reference.inverse_rms``).
"""

from __future__ import annotations

import pytest
import torch
from sm90_compile import compiled_variants

from kernels import layer_ops, reference
from kernels.reference import NormSpec, NormWeight, SpecError
from kernels.triton.invariant_rmsnorm import (
    COMPILE_SPECS,
    NormShapeError,
    invariant_add_rms_norm,
    invariant_rms_norm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROW_COUNTS = (1, 3, 17)
HIDDEN = (64, 96, 160)  # a power of two, and two that leave a masked tail (stand-ins for 2560)
SPECS = (
    NormSpec(NormWeight.W, eps=1e-6, round_before_weight=True),  # Qwen3 / Llama
    NormSpec(NormWeight.W, eps=1e-6),  # Gemma 4
    NormSpec(NormWeight.ONE_PLUS_W, eps=1e-6),  # Qwen3.5
    NormSpec(NormWeight.NONE, eps=1e-6),  # Gemma 4 V norm
)
SPEC_IDS = ("w-round-first", "w", "one-plus-w", "none")
DTYPES = (torch.float32, torch.bfloat16)


def _values(rows: int, hidden: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.float32:
        # Multiples of 1/8 in [-1, 1]: a sum of two is on the grid in [-2, 2], its square a multiple
        # of 1/64 up to 4, and 160 of those sum below 2²⁴/64, so fp32 sums them exactly in any order.
        return (torch.randint(-8, 9, (rows, hidden), generator=g) / 8).to(DEVICE)
    return torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)


def _weight(spec: NormSpec, hidden: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor | None:
    if spec.weight is NormWeight.NONE:
        return None
    return (torch.randn(hidden, generator=g) * 0.5 + 1.0).to(dtype).to(DEVICE)


def _reference_sqrt_is_ieee(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per row: did torch's fp32 sqrt inside ``reference.inverse_rms`` round correctly?

    Same torch ops as the reference up to the sqrt, which is then checked against fp64's (correctly
    rounded, and rounding it to fp32 is exact enough: 53 ≥ 2·24 + 2 bits).
    """
    before_sqrt = x.cpu().to(torch.float32).square().mean(dim=-1) + eps
    return torch.sqrt(before_sqrt) == torch.sqrt(before_sqrt.double()).float()


def _spec_on_host(x: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None) -> torch.Tensor:
    """``reference.rms_norm`` run on the CPU: the spec is host code (its ``inverse_rms`` says why
    torch's CUDA mean is not)."""
    return reference.rms_norm(x.cpu(), spec, None if weight is None else weight.cpu())


def _assert_is_spec(got: torch.Tensor, want: torch.Tensor, normed_input: torch.Tensor, eps: float) -> None:
    """Bit for bit; in fp32, rows where the reference's own sqrt was not IEEE to a tolerance."""
    got = got.cpu()
    exact = torch.ones(got.shape[0], dtype=torch.bool)
    if got.dtype == torch.float32:
        exact = _reference_sqrt_is_ieee(normed_input, eps)
        torch.testing.assert_close(got[~exact], want[~exact], rtol=4e-7, atol=0.0)
    assert torch.equal(got[exact], want[exact]), _first_difference(got[exact], want[exact])


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got.float() != want.float()).nonzero()
    if not len(bad):
        return "no difference"
    at = tuple(int(i) for i in bad[0])
    return f"{len(bad)} elements differ, first at {at}: {got[at].item()!r} vs spec {want[at].item()!r}"


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_rms_norm_is_the_spec_bit_for_bit(dtype: torch.dtype, spec: NormSpec, hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    weight = _weight(spec, hidden, dtype, g)
    bit_checked = 0
    for rows in ROW_COUNTS:
        x = _values(rows, hidden, dtype, g).to(dtype)
        got = invariant_rms_norm(x, spec, weight)
        assert got.dtype == dtype
        _assert_is_spec(got, _spec_on_host(x, spec, weight), x, spec.eps)
        bit_checked += int(_reference_sqrt_is_ieee(x, spec.eps).sum())
    assert bit_checked >= sum(ROW_COUNTS) // 2, f"only {bit_checked} rows compared bit for bit"


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_add_rms_norm_is_the_composition_bit_for_bit(dtype: torch.dtype, spec: NormSpec, hidden: int) -> None:
    g = torch.Generator().manual_seed(1000 + hidden)
    weight = _weight(spec, hidden, dtype, g)
    bit_checked = 0
    for rows in ROW_COUNTS:
        residual = _values(rows, hidden, dtype, g).to(dtype)
        delta = _values(rows, hidden, dtype, g).to(dtype)
        summed, normed = invariant_add_rms_norm(residual, delta, spec, weight)
        want_sum = residual + delta  # torch's own add in the storage dtype is the definition
        assert torch.equal(summed, want_sum), f"{rows} rows, sum: {_first_difference(summed, want_sum)}"
        _assert_is_spec(normed, _spec_on_host(want_sum, spec, weight), want_sum, spec.eps)
        bit_checked += int(_reference_sqrt_is_ieee(want_sum, spec.eps).sum())
    assert bit_checked >= sum(ROW_COUNTS) // 2, f"only {bit_checked} rows compared bit for bit"


@pytest.mark.parametrize("with_scale", (False, True), ids=("post-attention", "post-feedforward"))
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("spec", SPECS[1:3], ids=SPEC_IDS[1:3])
def test_gemma_residual_steps_are_the_composition_bit_for_bit(
    spec: NormSpec, hidden: int, with_scale: bool
) -> None:
    # Gemma 4's steps: the delta normalised with its own weight, added, (times the layer scalar),
    # then normalised with the next weight. bf16: the sum-of-squares order never shows at these seeds.
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(2000 + hidden)
    weight = _weight(spec, hidden, dtype, g)
    delta_weight = _weight(spec, hidden, dtype, g)
    scale = torch.tensor([0.7], dtype=dtype).to(DEVICE) if with_scale else None
    for rows in ROW_COUNTS:
        residual = _values(rows, hidden, dtype, g)
        delta = _values(rows, hidden, dtype, g) * 8  # a delta far from unit RMS, as an MLP's is
        summed, normed = invariant_add_rms_norm(
            residual, delta, spec, weight, delta_weight=delta_weight, scale=scale
        )
        want_sum, want_norm = reference.add_rms_norm(
            residual.cpu(),
            delta.cpu(),
            spec,
            None if weight is None else weight.cpu(),
            delta_weight=None if delta_weight is None else delta_weight.cpu(),
            scale=None if scale is None else scale.cpu(),
        )
        assert torch.equal(summed.cpu(), want_sum), (
            f"{rows} rows: {_first_difference(summed.cpu(), want_sum)}"
        )
        assert torch.equal(normed.cpu(), want_norm), (
            f"{rows} rows: {_first_difference(normed.cpu(), want_norm)}"
        )
    # The steps are not the plain add: the check above could not pass on a kernel that skipped them.
    plain_sum, _ = invariant_add_rms_norm(residual, delta, spec, weight)
    assert not torch.equal(plain_sum, summed)


def test_gemma_residual_step_refuses_what_it_cannot_take() -> None:
    x = torch.zeros(3, 64, device=DEVICE)
    ones = torch.ones(64, device=DEVICE)
    with pytest.raises(NormShapeError, match=r"delta_weight was given, but the norm spec has no weight"):
        invariant_add_rms_norm(x, x, NormSpec(NormWeight.NONE), delta_weight=ones)
    with pytest.raises(NormShapeError, match=r"scale is \(2,\) torch.float32"):
        invariant_add_rms_norm(x, x, SPECS[1], ones, scale=torch.ones(2, device=DEVICE))
    with pytest.raises(SpecError, match=r"scale is \(1,\) torch.bfloat16"):
        reference.add_rms_norm(x, x, SPECS[1], ones, scale=torch.ones(1, dtype=torch.bfloat16))


def test_bf16_sum_rounds_to_nearest_even_like_torch() -> None:
    # 1 + 2⁻⁸ lies halfway between bf16 neighbours 1 and 1 + 2⁻⁷: torch rounds to even (1.0),
    # and 1 + 3·2⁻⁸ rounds up to 1 + 2⁻⁶; truncation would give 1 + 2⁻⁷ for the second.
    residual = torch.ones(1, 64, dtype=torch.bfloat16, device=DEVICE)
    delta = torch.full((1, 64), 2.0**-8, dtype=torch.bfloat16, device=DEVICE)
    delta[0, 1::2] = 3 * 2.0**-8
    spec = NormSpec(NormWeight.NONE)
    summed, _ = invariant_add_rms_norm(residual, delta, spec)
    assert torch.equal(summed, residual + delta)
    assert summed[0, 0].item() == 1.0 and summed[0, 1].item() == 1.0 + 2.0**-6


def test_fp32_random_inputs_differ_at_most_in_the_sum_order() -> None:
    g = torch.Generator().manual_seed(3)
    spec = SPECS[0]
    x = torch.randn(17, 160, generator=g).to(DEVICE)
    delta = torch.randn(17, 160, generator=g).to(DEVICE)
    weight = _weight(spec, 160, torch.float32, g)
    torch.testing.assert_close(invariant_rms_norm(x, spec, weight), reference.rms_norm(x, spec, weight))
    summed, normed = invariant_add_rms_norm(x, delta, spec, weight)
    assert torch.equal(summed, x + delta)  # the add has no order freedom
    torch.testing.assert_close(normed, reference.rms_norm(x + delta, spec, weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=("fp32", "bf16"))
def test_rows_outside_the_batch_are_neither_read_nor_written(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    spec, hidden, start, rows = SPECS[1], 96, 2, 3
    weight = _weight(spec, hidden, dtype, g)
    # Inputs are rows [2, 5) of larger buffers whose other rows hold NaN: reading them would show.
    residual_buf = torch.full((8, hidden), float("nan"), dtype=dtype, device=DEVICE)
    delta_buf = residual_buf.clone()
    residual_buf[start : start + rows] = _values(rows, hidden, dtype, g).to(dtype)
    delta_buf[start : start + rows] = _values(rows, hidden, dtype, g).to(dtype)
    residual, delta = residual_buf[start : start + rows], delta_buf[start : start + rows]
    want_sum = residual + delta
    want_norm = _spec_on_host(want_sum, spec, weight)

    sentinel = -1234.0  # bf16-representable, so the untouched check is exact in both dtypes
    sum_buf = torch.full((8, hidden), sentinel, dtype=dtype, device=DEVICE)
    norm_buf = sum_buf.clone()
    out_rows = slice(4, 4 + rows)  # a different offset from the inputs'
    summed, normed = invariant_add_rms_norm(
        residual, delta, spec, weight, residual_out=sum_buf[out_rows], normed_out=norm_buf[out_rows]
    )
    assert (
        summed.data_ptr() == sum_buf[out_rows].data_ptr()
        and normed.data_ptr() == norm_buf[out_rows].data_ptr()
    )
    assert torch.equal(sum_buf[out_rows], want_sum)
    _assert_is_spec(norm_buf[out_rows], want_norm, want_sum, spec.eps)
    outside = torch.ones(8, dtype=torch.bool)
    outside[out_rows] = False
    for name, buf in (("residual_out", sum_buf), ("normed_out", norm_buf)):
        assert bool((buf[outside] == sentinel).all()), f"{name}: a row outside the batch was written"

    plain_buf = torch.full((8, hidden), sentinel, dtype=dtype, device=DEVICE)
    plain = invariant_rms_norm(want_sum, spec, weight, out=plain_buf[out_rows])
    _assert_is_spec(plain, want_norm, want_sum, spec.eps)
    assert bool((plain_buf[outside] == sentinel).all()), "out: a row outside the batch was written"


def test_residual_may_be_updated_in_place() -> None:
    g = torch.Generator().manual_seed(9)
    spec = SPECS[0]
    residual = _values(17, 160, torch.bfloat16, g)
    delta = _values(17, 160, torch.bfloat16, g)
    weight = _weight(spec, 160, torch.bfloat16, g)
    want_sum = residual + delta
    want_norm = reference.rms_norm(want_sum, spec, weight)
    summed, normed = invariant_add_rms_norm(residual, delta, spec, weight, residual_out=residual)
    assert summed is residual and torch.equal(residual, want_sum)
    assert torch.equal(normed, want_norm)


def test_add_rms_norm_rows_are_the_same_alone_and_in_a_batch() -> None:
    g = torch.Generator().manual_seed(13)
    spec = SPECS[1]
    residual = _values(17, 160, torch.bfloat16, g)
    delta = _values(17, 160, torch.bfloat16, g)
    weight = _weight(spec, 160, torch.bfloat16, g)
    full_sum, full_norm = invariant_add_rms_norm(residual, delta, spec, weight)
    for i in (0, 7, 16):
        s, n = invariant_add_rms_norm(residual[i : i + 1], delta[i : i + 1], spec, weight)
        assert torch.equal(s[0], full_sum[i]) and torch.equal(n[0], full_norm[i]), f"row {i}"


def test_kernel_refuses_what_it_cannot_take() -> None:
    spec = SPECS[1]
    x = torch.zeros(3, 64, device=DEVICE)
    with pytest.raises(NormShapeError, match=r"delta is \(3, 32\)"):
        invariant_add_rms_norm(x, torch.zeros(3, 32, device=DEVICE), spec, torch.ones(64, device=DEVICE))
    with pytest.raises(NormShapeError, match=r"torch.bfloat16"):
        invariant_add_rms_norm(x, x.bfloat16(), spec, torch.ones(64, device=DEVICE))
    with pytest.raises(NormShapeError, match=r"normed_out is \(2, 64\)"):
        invariant_add_rms_norm(
            x, x, spec, torch.ones(64, device=DEVICE), normed_out=torch.zeros(2, 64, device=DEVICE)
        )
    with pytest.raises(NormShapeError, match=r"last-dim stride 2"):
        invariant_rms_norm(
            x, spec, torch.ones(64, device=DEVICE), out=torch.zeros(3, 128, device=DEVICE)[:, ::2]
        )
    with pytest.raises(NormShapeError, match=r"weight='w' was given weight=None|'w' was given weight=None"):
        invariant_add_rms_norm(x, x, spec)


def test_dispatch_runs_the_spec_off_cuda() -> None:
    if DEVICE == "cuda":
        pytest.skip("on CUDA the dispatch takes the Triton kernel, tested above")
    g = torch.Generator().manual_seed(17)
    spec = SPECS[0]
    residual = _values(3, 96, torch.bfloat16, g)
    delta = _values(3, 96, torch.bfloat16, g)
    weight = _weight(spec, 96, torch.bfloat16, g)
    assert torch.equal(layer_ops.rms_norm(residual, spec, weight), reference.rms_norm(residual, spec, weight))
    summed, normed = layer_ops.add_rms_norm(residual, delta, spec, weight)
    assert torch.equal(summed, residual + delta)
    assert torch.equal(normed, reference.rms_norm(residual + delta, spec, weight))
    with pytest.raises(SpecError, match=r"delta is \(3, 96\) torch.float32"):
        layer_ops.add_rms_norm(residual, delta.float(), spec, weight)


def test_every_variant_compiles_for_sm90() -> None:
    compiled = compiled_variants("kernels.triton.invariant_rmsnorm")
    # Each spec plain and with a delta; specs with a weight also as Gemma 4's two residual steps.
    weighted = sum(spec.weight is not NormWeight.NONE for spec in COMPILE_SPECS)
    assert len(compiled) == 2 * len(COMPILE_SPECS) + 2 * weighted, compiled


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (PDL and graphs)")
@pytest.mark.parametrize("rows", [1, 2])
def test_gpu_a_pdl_chain_of_layers_replays_as_it_ran(rows: int) -> None:
    """Norm → GEMV → gated activation → GEMV → in-place residual add + norm, three layers, every
    launch PDL on sm_90+: a kernel that started early must still read what the one before it wrote.
    The graph's replays on fresh inputs equal eager runs on the same inputs, bit for bit."""
    from kernels.reference import GatedActivation
    from kernels.triton.fused_gemv import fused_gemv
    from kernels.triton.gated_act import gated_act

    hidden, inner = 2560, 1536  # Qwen3-4B's hidden width; a GEMV-sized MLP
    g = torch.Generator(device="cuda").manual_seed(5)
    spec = NormSpec(NormWeight.W, eps=1e-6, round_before_weight=True)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    layers = [
        (randn(hidden, scale=0.1) + 1, randn(2 * inner, hidden, scale=0.02), randn(hidden, inner, scale=0.02))
        for _ in range(3)
    ]

    def chain(residual: torch.Tensor) -> torch.Tensor:
        x = invariant_rms_norm(residual, spec, layers[0][0])
        for norm_w, gate_up, down in layers:
            activated = gated_act(fused_gemv(x, gate_up), GatedActivation.SILU)
            residual, x = invariant_add_rms_norm(
                residual, fused_gemv(activated, down), spec, norm_w, residual_out=residual
            )
        return x

    static = randn(rows, hidden)
    chain(static.clone())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    for _ in range(3):
        fresh = randn(rows, hidden)
        expected = chain(fresh.clone())
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, expected)
