"""The fused decode GEMV (kernels/triton/fused_gemv.py) at small shapes: under the interpreter on a
CPU, compiled on a GPU when there is one; plus an sm_90 compile check of every variant with PDL.

Shapes: N = 40 output rows (a masked last program at 16 rows per program), K = 64 (unmasked), 96 and
160 (masked tails of 32 and 96 in the 128- and 256-wide tile); rows 1 and ``MAX_ROWS``.

Against the spec (``reference.norm_linear`` / ``linear_residual`` / ``linear_gated``, compositions of
spec ops), with bounds built from what the spec's own freedoms cost, measured in the same run:

* the linear's fp32 sum order: ``tests/kernels/linear_bounds.py`` (per element
  ``16·u·Σ|x w| + ulp_S``, at most 8× the measured share of flipped elements);
* the norm's sum-of-squares order: the spec run on the hidden row with its columns permuted (so its
  sum of squares is added in another order) must move no normalised element on these operands
  (measured: 0 of 1,600 bf16/fp16 elements per permutation), so the linear bound holds unchanged;
  fp32 outputs move by fp32 ulps there, which the linear bound's ``16·u·Σ|x w|`` term covers;
* the residual epilogue: the linear's bound, plus one rounding of the add (``ulp_S(y)``); a result
  differs only where the rounded projection does, so the share bound carries over;
* the gated epilogue: per element, how far the spec moves when each rounded projection output
  moves by the linear bound (the spec itself evaluated at the perturbed gate and up), plus the
  envelope of exp's last fp32 bit from ``test_gated_act.py``; at most twice the linear's share of
  flips (gate and up) plus the share exp's and tanh's last bit flips (``TRANSCENDENTAL_SHARE``).

Against the unfused kernels, bit for bit: the fused prologue and epilogues are the same jit helpers as
``invariant_rms_norm``, ``gated_act`` and torch's rounded add, so each fused variant is the plain GEMV
composed with them exactly. The one freedom left, the order in which the prologue and
``invariant_rms_norm`` add the squares (their reductions have different layouts on the GPU), is
taken away by hidden rows whose sum of squares is exact in fp32 (``fused_bounds.order_free_rows``).

Metamorphic, bit for bit: row offset 1 against 0 with sentinel rows and columns untouched; a row
alone against the same row inside a batch of ``MAX_ROWS``; two runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from fused_bounds import TRANSCENDENTAL_SHARE, order_free_rows
from fused_bounds import check_within as _check
from fused_bounds import gated_allowed as _gated_allowed
from fused_bounds import linear_allowed as _linear_allowed
from fused_bounds import norm_order_flips as _norm_order_flips
from linear_bounds import FLIP_SHARE_BOUND, agreement, ulp
from sm90_compile import compiled_variants

from kernels import reference
from kernels.reference import GatedActivation, NormSpec, NormWeight
from kernels.triton.fused_gemv import (
    COMPILE_VARIANTS,
    MAX_ROWS,
    FusedGemvError,
    Fusion,
    GemvSettings,
    fused_gemv,
    gemv_settings,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 40
KS = (64, 96, 160)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# K as one masked power-of-two block, and in a power-of-two head and tail (the default layout):
# 96 = 64 + 32 and 160 = 128 + 32 (64 stays one block).
ONE_BLOCK = GemvSettings(rows_per_program=2)
TAIL = GemvSettings(rows_per_program=2, k_tail=True)
SETTINGS = {
    "default": None,
    "r16": GemvSettings(rows_per_program=16),
    "r1": GemvSettings(rows_per_program=1),
    "tail": TAIL,
}
LAYOUTS = {"one-block": ONE_BLOCK, "tail": TAIL}
QWEN3_NORM = NormSpec(NormWeight.W, eps=1e-6, round_before_weight=True)
NORMS = (QWEN3_NORM, NormSpec(NormWeight.ONE_PLUS_W), NormSpec(NormWeight.NONE))


def _ids(values: tuple[object, ...]) -> list[str]:
    return [str(v).removeprefix("torch.") for v in values]


def _tensors(m: int, k: int, dtype: torch.dtype, *, n: int = N, seed: int = 3) -> dict[str, torch.Tensor]:
    """x (or the hidden row), a weight w ~ N(0, 1/K), a norm weight near 1 and a residual."""
    g = torch.Generator().manual_seed(seed + k)
    made = {
        "x": torch.randn(m, k, generator=g) * 2,
        "w": torch.randn(n, k, generator=g) / k**0.5,
        "norm_weight": 1 + 0.3 * torch.randn(k, generator=g),
        "residual": torch.randn(m, n, generator=g) * 4,
        "gate_up": torch.randn(2 * n, k, generator=g) * (3 / k**0.5),  # gates out to ±8: silu's tails
    }
    return {name: t.to(dtype).to(DEVICE) for name, t in made.items()}


def _norm_weight(spec: NormSpec, t: dict[str, torch.Tensor]) -> torch.Tensor | None:
    return None if spec.weight is NormWeight.NONE else t["norm_weight"]


# --------------------------------------------------------------------------------- against the spec


def test_specs_are_compositions_of_spec_ops() -> None:
    t = _tensors(2, 64, torch.bfloat16)
    x, w, nw, r = (t[name].cpu() for name in ("x", "w", "norm_weight", "residual"))
    normed = reference.rms_norm(x, QWEN3_NORM, nw)
    assert torch.equal(reference.norm_linear(x, QWEN3_NORM, nw, w), reference.linear(normed, w))
    assert torch.equal(reference.linear_residual(x, w, r), r + reference.linear(x, w))
    gu = t["gate_up"].cpu()
    silu = reference.gated_activation(reference.linear(x, gu), GatedActivation.SILU)
    assert torch.equal(reference.linear_gated(x, gu, GatedActivation.SILU), silu)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_plain_gemv_is_the_spec_within_the_reordering_bound(name: str, dtype: torch.dtype) -> None:
    for k, m in itertools.product(KS, (1, MAX_ROWS)):
        t = _tensors(m, k, dtype)
        y = fused_gemv(t["x"], t["w"], settings=SETTINGS[name])
        assert y.shape == (m, N) and y.dtype == dtype
        verdict = agreement(y, reference.linear(t["x"].cpu(), t["w"].cpu()), t["x"], t["w"])
        assert verdict.ok, f"K={k} M={m}: {verdict}"


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("spec", NORMS, ids=lambda s: f"{s.weight.value}-rbw{int(s.round_before_weight)}")
def test_norm_prologue_is_the_spec_within_the_reordering_bound(spec: NormSpec, dtype: torch.dtype) -> None:
    for k in KS:
        t = _tensors(MAX_ROWS, k, dtype)
        nw = _norm_weight(spec, t)
        if dtype != torch.float32:  # the measurement the module doc states: no normalised bit moves
            assert _norm_order_flips(t["x"], spec, nw) == 0, f"K={k}"
        want = reference.norm_linear(t["x"].cpu(), spec, None if nw is None else nw.cpu(), t["w"].cpu())
        normed = reference.rms_norm(t["x"].cpu(), spec, None if nw is None else nw.cpu())
        for settings in (ONE_BLOCK, TAIL):
            y = fused_gemv(t["x"], t["w"], Fusion(norm=spec), settings, norm_weight=nw)
            verdict = agreement(y, want, normed, t["w"])
            assert verdict.ok, f"K={k} {settings}: {verdict}"


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_residual_epilogue_is_the_spec_within_the_bound(dtype: torch.dtype) -> None:
    for k, m in itertools.product(KS, (1, MAX_ROWS)):
        t = _tensors(m, k, dtype)
        x, w = t["x"].cpu(), t["w"].cpu()
        want = reference.linear_residual(x, w, t["residual"].cpu())
        allowed = _linear_allowed(x, w, reference.linear(x, w))
        if dtype != torch.float32:
            allowed = allowed + ulp(want, dtype)
        for settings in (ONE_BLOCK, TAIL):
            y = fused_gemv(t["x"], t["w"], Fusion(residual=True), settings, residual=t["residual"])
            _check(y, want, allowed, FLIP_SHARE_BOUND[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("kind", tuple(GatedActivation), ids=lambda k: k.value)
@pytest.mark.parametrize("with_norm", [False, True], ids=["gated", "norm-gated"])
def test_gated_epilogue_is_the_spec_within_the_bound(
    with_norm: bool, kind: GatedActivation, dtype: torch.dtype
) -> None:
    for k in KS:
        t = _tensors(MAX_ROWS, k, dtype)
        fusion = Fusion(norm=QWEN3_NORM if with_norm else None, activation=kind)
        nw = t["norm_weight"] if with_norm else None
        y, y_tail = (fused_gemv(t["x"], t["gate_up"], fusion, s, norm_weight=nw) for s in (ONE_BLOCK, TAIL))
        assert y.shape == (MAX_ROWS, N) and y.dtype == dtype
        x = (
            reference.rms_norm(t["x"].cpu(), QWEN3_NORM, t["norm_weight"].cpu())
            if with_norm
            else t["x"].cpu()
        )
        if with_norm and dtype != torch.float32:
            assert _norm_order_flips(t["x"], QWEN3_NORM, nw) == 0, f"K={k}"
        want = reference.linear_gated(x, t["gate_up"].cpu(), kind)
        share = 2 * FLIP_SHARE_BOUND[dtype] + TRANSCENDENTAL_SHARE
        _check(y, want, _gated_allowed(x, t["gate_up"], kind), share)
        _check(y_tail, want, _gated_allowed(x, t["gate_up"], kind), share)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_fused_variants_are_the_unfused_kernels_composed_bit_for_bit(dtype: torch.dtype) -> None:
    from kernels.triton.gated_act import gated_act
    from kernels.triton.invariant_rmsnorm import invariant_rms_norm

    for k, settings in itertools.product(KS, (ONE_BLOCK, TAIL)):
        t = _tensors(MAX_ROWS, k, dtype)
        x, w, gu, nw = t["x"], t["w"], t["gate_up"], t["norm_weight"]
        # The norm prologue on hidden rows whose sum of squares no reduction order can move.
        hidden = order_free_rows(MAX_ROWS, k, dtype)
        normed = invariant_rms_norm(hidden, QWEN3_NORM, nw)
        fused_norm = fused_gemv(hidden, w, Fusion(norm=QWEN3_NORM), settings, norm_weight=nw)
        assert torch.equal(fused_norm, fused_gemv(normed, w, settings=settings)), f"K={k} {settings}: norm"
        residual = fused_gemv(x, w, Fusion(residual=True), settings, residual=t["residual"])
        plain = fused_gemv(x, w, settings=settings)
        assert torch.equal(residual, t["residual"] + plain), f"K={k} {settings}: residual"
        for kind in GatedActivation:
            gated = fused_gemv(x, gu, Fusion(activation=kind), settings)
            assert torch.equal(gated, gated_act(fused_gemv(x, gu, settings=settings), kind)), (
                f"K={k}: {kind.value}"
            )
            gated = fused_gemv(hidden, gu, Fusion(norm=QWEN3_NORM, activation=kind), settings, norm_weight=nw)
            unfused = gated_act(fused_gemv(normed, gu, settings=settings), kind)
            assert torch.equal(gated, unfused), f"K={k} {settings}: norm + {kind.value}"


def test_the_bounds_reject_a_wrong_rounding_point() -> None:
    # What the bounds exist to catch: rounding the gate and up halves' sum to bf16 per 16-column
    # chunk (a split-K that rounds its partials), or leaving the residual add unrounded in fp32.
    t = _tensors(MAX_ROWS, 160, torch.bfloat16)
    x, gu = t["x"].cpu(), t["gate_up"].cpu()
    parts = [reference.linear(x[:, i : i + 16], gu[:, i : i + 16]).float() for i in range(0, 160, 16)]
    rounded_partials = torch.stack(parts).sum(0).to(torch.bfloat16)
    wrong = reference.gated_activation(rounded_partials, GatedActivation.SILU)
    want = reference.linear_gated(x, gu, GatedActivation.SILU)
    with pytest.raises(AssertionError):
        _check(
            wrong,
            want,
            _gated_allowed(x, gu, GatedActivation.SILU),
            2 * FLIP_SHARE_BOUND[torch.bfloat16] + 0.01,
        )
    w, r = t["w"].cpu(), t["residual"].cpu()
    truncated = (r.float() + reference.linear(x, w).float()).view(torch.int32) & ~0xFFFF
    want = reference.linear_residual(x, w, r)
    allowed = _linear_allowed(x, w, reference.linear(x, w)) + ulp(want, torch.bfloat16)
    with pytest.raises(AssertionError):
        _check(
            truncated.view(torch.float32).to(torch.bfloat16), want, allowed, FLIP_SHARE_BOUND[torch.bfloat16]
        )


# -------------------------------------------------------------------------------------- metamorphic

FUSIONS = {
    "plain": Fusion(),
    "norm": Fusion(norm=QWEN3_NORM),
    "residual": Fusion(residual=True),
    "norm-silu": Fusion(norm=QWEN3_NORM, activation=GatedActivation.SILU),
}


def _run(
    fusion: Fusion,
    t: dict[str, torch.Tensor],
    x: torch.Tensor,
    settings: GemvSettings | None = None,
    /,
    **kw: torch.Tensor,
) -> torch.Tensor:
    weight = t["gate_up"] if fusion.activation else t["w"]
    nw = t["norm_weight"] if fusion.norm else None
    return fused_gemv(x, weight, fusion, settings, norm_weight=nw, **kw)


def _into_sentinels(
    fusion: Fusion, t: dict[str, torch.Tensor], offset: int, settings: GemvSettings | None = None
) -> tuple[torch.Tensor, bool]:
    """Run with x, the residual and the output ``offset`` rows into wider buffers (junk input rows
    around them, row strides that are not K or N) and sentinel output rows and columns around the
    result. Returns (the written rows, whether every sentinel is unchanged)."""
    x, dtype = t["x"], t["x"].dtype
    m, k = x.shape
    x_buf = torch.full((m + 2, k + 16), 1e4, dtype=dtype, device=DEVICE)
    x_buf[offset : offset + m, :k] = x
    extra: dict[str, torch.Tensor] = {}
    if fusion.residual:
        r_buf = torch.full((m + 2, N + 8), -1e4, dtype=dtype, device=DEVICE)
        r_buf[offset : offset + m, :N] = t["residual"]
        extra["residual"] = r_buf[offset : offset + m, :N]
    sentinel = torch.full((m + 2, N + 8), -7.0, dtype=dtype, device=DEVICE)
    y_buf = sentinel.clone()
    _run(fusion, t, x_buf[offset : offset + m, :k], settings, out=y_buf[offset : offset + m, :N], **extra)
    outside = torch.ones_like(y_buf, dtype=torch.bool)
    outside[offset : offset + m, :N] = False
    return y_buf[offset : offset + m, :N], torch.equal(y_buf[outside], sentinel[outside])


def _plain_kwargs(fusion: Fusion, t: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {"residual": t["residual"][rows]} if fusion.residual else {}


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name", list(FUSIONS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_row_offset_one_matches_offset_zero_and_leaves_sentinels(
    layout: str, name: str, dtype: torch.dtype
) -> None:
    # K = 112 is a 64-wide head and a 64-wide tail with 16 lanes masked: the junk past K in each
    # input row must not reach the result.
    settings = LAYOUTS[layout]
    tail = settings.k_tail
    fusion, k = FUSIONS[name], 112 if tail else 96
    for m in (1, MAX_ROWS):
        t = _tensors(m, k, dtype)
        at_zero, kept_zero = _into_sentinels(fusion, t, 0, settings)
        at_one, kept_one = _into_sentinels(fusion, t, 1, settings)
        assert kept_zero and kept_one, f"M={m}: an element outside the output rows and columns changed"
        assert torch.equal(at_one, at_zero), f"M={m}: offset 1 differs from offset 0"
        fresh = _run(fusion, t, t["x"], settings, **_plain_kwargs(fusion, t, slice(None)))
        assert torch.equal(fresh, at_zero), f"M={m}: a fresh output differs"
        if tail:  # and the result is the spec's, so a mask that let the junk in cannot pass as equal
            want = _run(fusion, t, t["x"], ONE_BLOCK, **_plain_kwargs(fusion, t, slice(None)))
            assert (fresh.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max() + 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name", list(FUSIONS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_row_alone_matches_the_row_in_a_batch_of_max_rows(
    layout: str, name: str, dtype: torch.dtype
) -> None:
    fusion, settings = FUSIONS[name], LAYOUTS[layout]
    t = _tensors(MAX_ROWS, 160, dtype)
    batch = _run(fusion, t, t["x"], settings, **_plain_kwargs(fusion, t, slice(None)))
    for r in range(MAX_ROWS):
        alone = _run(fusion, t, t["x"][r : r + 1], settings, **_plain_kwargs(fusion, t, slice(r, r + 1)))
        assert torch.equal(alone[0], batch[r]), f"row {r}"
    head = _run(fusion, t, t["x"][:2], settings, **_plain_kwargs(fusion, t, slice(0, 2)))
    assert torch.equal(head, batch[:2])


@pytest.mark.parametrize("name", list(FUSIONS))
def test_two_runs_are_identical(name: str) -> None:
    fusion = FUSIONS[name]
    for dtype in DTYPES:
        t = _tensors(3, 160, dtype)
        kwargs = _plain_kwargs(fusion, t, slice(None))
        assert torch.equal(_run(fusion, t, t["x"], **kwargs), _run(fusion, t, t["x"], **kwargs)), dtype


def test_empty_batch() -> None:
    t = _tensors(1, 64, torch.bfloat16)
    assert fused_gemv(t["x"][:0], t["w"]).shape == (0, N)


# ------------------------------------------------------------------------------- settings, refusals


def test_settings_follow_the_weight_shape_only() -> None:
    # The probe's rule: 8192 elements per slice (2 rows at K = 2560 or 4096, 1 at 9728); K in a
    # head and a tail where that loads fewer lanes than one block.
    assert gemv_settings(6144, 2560).k_blocks(2560) == (2048, 512)
    assert gemv_settings(2560, 9728).k_blocks(9728) == (8192, 2048)
    assert gemv_settings(2560, 4096).k_blocks(4096) == (4096, 0)
    assert gemv_settings(30720, 3840).k_blocks(3840) == (4096, 0)  # 2048 + 2048 masks as many
    assert gemv_settings(3840, 15360).k_blocks(15360) == (16384, 0)
    assert gemv_settings(6144, 2560).rows_per_program == 2
    assert gemv_settings(2560, 4096).rows_per_program == 2
    assert gemv_settings(2560, 9728).rows_per_program == 1
    assert gemv_settings(9728, 2560, gated=True).rows_per_program == 1  # two 4096-wide slices
    assert gemv_settings(40, 64).rows_per_program == 128
    with pytest.raises(FusedGemvError, match="rows_per_program=3"):
        GemvSettings(rows_per_program=3)


def test_refusals_name_the_shape() -> None:
    t = _tensors(MAX_ROWS + 1, 64, torch.bfloat16)
    x, w = t["x"], t["w"]
    with pytest.raises(FusedGemvError, match=r"gemv x \[5, 64\] @ w \[40, 64\].*M=5.*at most 4"):
        fused_gemv(x, w)
    with pytest.raises(FusedGemvError, match=r"\[2, 40\].*K=40 is not a positive multiple of 16"):
        fused_gemv(x[:2, :40], w[:, :40].contiguous())
    with pytest.raises(FusedGemvError, match=r"dtypes x=torch\.bfloat16, weight=torch\.float32"):
        fused_gemv(x[:2], w.float())
    with pytest.raises(FusedGemvError, match="last dim has stride 2"):
        fused_gemv(x[:2, ::2], w[:, :32].contiguous())
    with pytest.raises(FusedGemvError, match="weight must be contiguous"):
        fused_gemv(x[:2], torch.cat([w, w], dim=1)[:, :64])
    wide = torch.zeros(2, 32768, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(FusedGemvError, match=r"\[2, 32768\].*slice holds 32768 elements, over the 16384"):
        fused_gemv(torch.zeros(1, 32768, dtype=torch.bfloat16, device=DEVICE), wide)
    with pytest.raises(FusedGemvError, match="slice holds 32768 elements"):
        fused_gemv(x[:1], w, settings=GemvSettings(rows_per_program=512))
    with pytest.raises(FusedGemvError, match="N=41 is odd"):
        fused_gemv(
            x[:1],
            torch.zeros(41, 64, dtype=torch.bfloat16, device=DEVICE),
            Fusion(activation=GatedActivation.SILU),
        )
    with pytest.raises(FusedGemvError, match="one epilogue"):
        Fusion(residual=True, activation=GatedActivation.SILU)
    with pytest.raises(FusedGemvError, match="norm weight 'w' was given norm_weight=None"):
        fused_gemv(x[:1], w, Fusion(norm=QWEN3_NORM))
    with pytest.raises(FusedGemvError, match=r"norm_weight is \(32,\)"):
        fused_gemv(x[:1], w, Fusion(norm=QWEN3_NORM), norm_weight=t["norm_weight"][:32])
    with pytest.raises(FusedGemvError, match="residual=None for gemv\\+residual"):
        fused_gemv(x[:1], w, Fusion(residual=True))
    with pytest.raises(FusedGemvError, match=r"residual is \(2, 40\).*not \[1, 40\]"):
        fused_gemv(x[:1], w, Fusion(residual=True), residual=t["residual"][:2])
    with pytest.raises(FusedGemvError, match=r"out is \(1, 39\)"):
        fused_gemv(x[:1], w, out=torch.empty(1, 39, dtype=torch.bfloat16, device=DEVICE))


# ----------------------------------------------------------------------------- sm_90 compile check


def test_every_variant_compiles_for_sm90_with_pdl_and_16_byte_loads() -> None:
    compiled = compiled_variants("kernels.triton.fused_gemv")
    assert len(compiled) == len(COMPILE_VARIANTS), compiled


# ------------------------------------------------------ GPU only: serving shapes, graphs and PDL

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
QWEN35_NORM = NormSpec(NormWeight.ONE_PLUS_W, eps=1e-6)
# Each line's decode projections ([N, K]; gate/up is the fused [2I, K]) with their fusions: Qwen3-4B's
# layer and LM head; what Qwen3.5-4B adds (GDN's norm + in_proj, the `1 + w` norm + gate/up; its
# out_proj, O and down are Qwen3's residual shapes); Gemma 4 12B's plain projections and GELU gate/up.
SERVING = {
    "qkv": (6144, 2560, Fusion(norm=QWEN3_NORM)),
    "o": (2560, 4096, Fusion(residual=True)),
    "gate-up": (19456, 2560, Fusion(norm=QWEN3_NORM, activation=GatedActivation.SILU)),
    "down": (2560, 9728, Fusion(residual=True)),
    "lm-head": (151936, 2560, Fusion()),
    "qwen35-in-proj": (12352, 2560, Fusion(norm=QWEN35_NORM)),
    "qwen35-gate-up": (18432, 2560, Fusion(norm=QWEN35_NORM, activation=GatedActivation.SILU)),
    "gemma4-qkv": (8192, 3840, Fusion()),
    "gemma4-global-o": (3840, 8192, Fusion()),
    "gemma4-gate-up": (30720, 3840, Fusion(activation=GatedActivation.GELU_TANH)),
    "gemma4-down": (3840, 15360, Fusion()),
    "gemma4-lm-head": (262144, 3840, Fusion()),
}


def _layout(layout: str, n_out: int, k: int, gated: bool) -> GemvSettings:
    """The shape's default rows and warps in one of the layouts (K in one block, or head + tail)."""
    default = gemv_settings(n_out, k, gated=gated)
    return GemvSettings(default.rows_per_program, default.num_warps, k_tail=LAYOUTS[layout].k_tail)


@needs_cuda
@pytest.mark.parametrize("name", list(SERVING))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_serving_shapes_are_batch_invariant_and_within_the_bound(layout: str, name: str) -> None:
    n, k, fusion = SERVING[name]
    n_out, gated = (n // 2, True) if fusion.activation else (n, False)
    settings = _layout(layout, n_out, k, gated)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(MAX_ROWS, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    residual = torch.randn(MAX_ROWS, n_out, device="cuda", generator=g).to(torch.bfloat16)

    def run(rows: slice) -> torch.Tensor:
        return fused_gemv(
            x[rows],
            w,
            fusion,
            settings,
            norm_weight=nw if fusion.norm else None,
            residual=residual[rows] if fusion.residual else None,
        )

    full = run(slice(None))
    for m in range(1, MAX_ROWS):
        assert torch.equal(run(slice(0, m)), full[:m]), f"first {m} rows"
    assert torch.equal(run(slice(2, 3))[0], full[2])
    xs = reference.rms_norm(x.cpu(), fusion.norm, nw.cpu()) if fusion.norm else x.cpu()
    if fusion.activation:
        want = reference.linear_gated(xs, w.cpu(), fusion.activation)
        allowed = _gated_allowed(xs, w, fusion.activation)
    else:
        want = reference.linear(xs, w.cpu())
        allowed = _linear_allowed(xs, w, want)
        if fusion.residual:
            want = reference.linear_residual(xs, w.cpu(), residual.cpu())
            allowed = allowed + ulp(want, torch.bfloat16)
    # Per element only: the share of flips is printed, not held to the interpreter's figures.
    _check(full, want, allowed, share=1.0)
    print(
        f"{name} {layout}: {int((full.cpu() != want).sum())} of {want.numel()} elements differ from the spec"
    )


@needs_cuda
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_graph_replay_of_a_pdl_chain_matches_eager(layout: str) -> None:
    from kernels.triton.storage import pdl_supported

    assert pdl_supported(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(2, 2560, device="cuda", generator=g).to(torch.bfloat16)
    nw = torch.ones(2560, device="cuda", dtype=torch.bfloat16)
    ws = [(torch.randn(2560, 2560, device="cuda", generator=g) / 50).to(torch.bfloat16) for _ in range(6)]

    def chain() -> torch.Tensor:
        h = hidden
        settings = _layout(layout, 2560, 2560, gated=False)
        for first, second in zip(ws[::2], ws[1::2], strict=True):  # each launch reads the last one's output
            y = fused_gemv(h, first, Fusion(norm=QWEN3_NORM), settings, norm_weight=nw)
            h = fused_gemv(y, second, Fusion(residual=True), settings, residual=h)
        return h

    eager = chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
