"""The projections seam (kernels/gemm/projections.py): the composed ops are the forward's ops bit for
bit; the fused implementation routes decode-sized steps to the fused GEMV (up to 4 rows) or the
fused MMA (5-64 rows) and everything else (more rows, a reduce, a shape the kernel refuses, logged
once by name) to the composition; only `tuned` asks for it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from linear_bounds import agreement

from kernels import layer_ops, reference
from kernels.gemm.projections import ComposedProjections, FusedDecodeProjections, policy_projections
from kernels.reference import GatedActivation, NormSpec, NormWeight
from kernels.triton.fused_gemv import MAX_ROWS as GEMV_MAX_ROWS
from kernels.triton.fused_gemv import Fusion, fused_gemv, gemv_settings
from kernels.triton.fused_mma import MAX_ROWS as MMA_MAX_ROWS
from kernels.triton.fused_mma import fused_mma

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NORM = NormSpec(NormWeight.W, eps=1e-6, round_before_weight=True)
K, N = 64, 48


def _tensors(m: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    made = {
        "h": torch.randn(m, K, generator=g) * 2,
        "w": torch.randn(N, K, generator=g) / K**0.5,
        "norm_weight": 1 + 0.3 * torch.randn(K, generator=g),
        "residual": torch.randn(m, N, generator=g),
        "gate_up": torch.randn(2 * N, K, generator=g) / K**0.5,
        "down": torch.randn(K, N, generator=g) / N**0.5,
    }
    return {name: t.to(dtype).to(DEVICE) for name, t in made.items()}


def test_composed_ops_are_the_forwards_ops_bit_for_bit() -> None:
    t = _tensors(6)
    p = ComposedProjections(F.linear)
    normed = layer_ops.rms_norm(t["h"], NORM, t["norm_weight"])
    assert torch.equal(p.norm_linear(t["h"], NORM, t["norm_weight"], t["w"]), F.linear(normed, t["w"]))
    delta = F.linear(t["h"], t["w"])
    summed, _ = layer_ops.add_rms_norm(
        t["residual"], delta, NORM, torch.ones(N, dtype=torch.bfloat16, device=DEVICE)
    )
    assert torch.equal(p.linear_residual(t["h"], t["w"], t["residual"]), summed)
    doubled = p.linear_residual(t["h"], t["w"], t["residual"], reduce=lambda d: d * 2)
    assert torch.equal(doubled, t["residual"] + delta * 2)
    gated = layer_ops.gated_activation(F.linear(normed, t["gate_up"]), GatedActivation.SILU)
    got = p.norm_linear_gated(t["h"], NORM, t["norm_weight"], t["gate_up"], GatedActivation.SILU)
    assert torch.equal(got, gated)
    assert torch.equal(p(t["h"], t["w"]), F.linear(t["h"], t["w"]))
    assert not p.fuses(1, torch.device(DEVICE))


def _kernel_for(m: int) -> Callable[..., torch.Tensor]:
    return fused_gemv if m <= GEMV_MAX_ROWS else fused_mma


def test_decode_rows_run_the_fused_kernels_and_larger_steps_compose() -> None:
    fused, composed = FusedDecodeProjections(F.linear), ComposedProjections(F.linear)
    device = torch.device(DEVICE)
    assert (
        fused.fuses(1, device)
        and fused.fuses(GEMV_MAX_ROWS + 1, device)
        and fused.fuses(MMA_MAX_ROWS, device)
    )
    assert not fused.fuses(MMA_MAX_ROWS + 1, device) and not fused.fuses(0, device)
    # Up to 4 rows the GEMV, 5-64 the MMA (each bit for bit), 65 composed.
    for m in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 20, MMA_MAX_ROWS + 1):
        t = _tensors(m)
        h, nw, w, r = t["h"], t["norm_weight"], t["w"], t["residual"]
        small = m <= MMA_MAX_ROWS
        kernel = _kernel_for(m)
        want = (
            kernel(h, w, Fusion(norm=NORM), norm_weight=nw) if small else composed.norm_linear(h, NORM, nw, w)
        )
        assert torch.equal(fused.norm_linear(h, NORM, nw, w), want), m
        want = kernel(h, w, Fusion(residual=True), residual=r) if small else composed.linear_residual(h, w, r)
        assert torch.equal(fused.linear_residual(h, w, r), want), m
        kind = GatedActivation.SILU
        gu = t["gate_up"]
        want = (
            kernel(h, gu, Fusion(norm=NORM, activation=kind), norm_weight=nw)
            if small
            else composed.norm_linear_gated(h, NORM, nw, gu, kind)
        )
        assert torch.equal(fused.norm_linear_gated(h, NORM, nw, gu, kind), want), m
        want = (
            kernel(h, gu, Fusion(activation=kind))
            if small
            else composed.norm_linear_gated(h, None, None, gu, kind)
        )
        assert torch.equal(fused.norm_linear_gated(h, None, None, gu, kind), want), m


def test_a_reduce_keeps_the_residual_composed() -> None:
    t = _tensors(1)
    fused = FusedDecodeProjections(F.linear)
    got = fused.linear_residual(t["h"], t["w"], t["residual"], reduce=lambda d: d * 2)
    assert torch.equal(got, t["residual"] + F.linear(t["h"], t["w"]) * 2)


def test_a_refused_shape_composes_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    fused = FusedDecodeProjections(F.linear)
    h = torch.randn(1, 40, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(24, 40, dtype=torch.bfloat16, device=DEVICE)
    nw = torch.ones(40, dtype=torch.bfloat16, device=DEVICE)
    with caplog.at_level(logging.WARNING, logger="infer.gemm"):
        for _ in range(2):
            got = fused.norm_linear(h, NORM, nw, w)
            assert torch.equal(got, ComposedProjections(F.linear).norm_linear(h, NORM, nw, w))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "norm_linear over weight [24, 40]" in messages[0], messages
    assert "K=40 is not a positive multiple of 16" in messages[0]
    caplog.clear()
    h8 = torch.randn(8, 40, dtype=torch.bfloat16, device=DEVICE)
    with caplog.at_level(logging.WARNING, logger="infer.gemm"):
        got = fused.linear_residual(h8, w, h8[:, :24].contiguous())
    assert torch.equal(got, ComposedProjections(F.linear).linear_residual(h8, w, h8[:, :24].contiguous()))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "linear_residual over weight [24, 40]" in messages[0], messages
    assert "(mma)" in messages[0] and "K=40 is not a positive multiple of 16" in messages[0]


def test_only_tuned_asks_for_the_fused_path(caplog: pytest.LogCaptureFixture) -> None:
    device = torch.device(DEVICE)
    assert type(policy_projections("tuned", device, F.linear, decode_fusion=False)) is ComposedProjections
    assert isinstance(
        policy_projections("tuned", device, F.linear, decode_fusion=True), FusedDecodeProjections
    )
    with caplog.at_level(logging.INFO, logger="infer.gemm"):
        for policy in ("invariant", "pin", "per-token"):
            chosen = policy_projections(policy, device, F.linear, decode_fusion=True)
            assert type(chosen) is ComposedProjections, policy
    assert sum("one kernel for every row count" in r.getMessage() for r in caplog.records) == 3


def test_without_cuda_or_the_interpreter_it_composes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    chosen = policy_projections("tuned", torch.device("cpu"), F.linear, decode_fusion=True)
    assert type(chosen) is ComposedProjections
    assert not FusedDecodeProjections(F.linear).fuses(1, torch.device("cpu"))


def test_the_plain_projection_runs_the_fused_kernels_on_steps_they_cover(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fused = FusedDecodeProjections(F.linear)
    for m in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, MMA_MAX_ROWS + 1):
        t = _tensors(m)
        if m <= GEMV_MAX_ROWS:
            want = fused_gemv(t["h"], t["w"])
        elif m <= MMA_MAX_ROWS:
            want = fused_mma(t["h"], t["w"])
        else:
            want = F.linear(t["h"], t["w"])
        assert torch.equal(fused(t["h"], t["w"]), want), m
    h = torch.randn(1, 40, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(24, 40, dtype=torch.bfloat16, device=DEVICE)
    with caplog.at_level(logging.WARNING, logger="infer.gemm"):
        for _ in range(2):
            assert torch.equal(fused(h, w), F.linear(h, w))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "linear over weight [24, 40]" in messages[0], messages


def test_an_lm_head_wide_projection_is_the_spec_and_a_row_alone_is_the_row_in_the_batch() -> None:
    """Qwen3's vocabulary of output rows (K kept small for the interpreter): 297 programs of 512 rows,
    the last one masked past row 151936; every row within the linear's reordering bound of the spec
    (``linear_bounds``), and each row alone the same bits as inside the 4-row batch."""
    n, k = 151936, 16
    settings = gemv_settings(n, k)
    assert n % settings.rows_per_program, "the shape must leave the last program a masked tail"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(GEMV_MAX_ROWS, k, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).to(DEVICE)
    fused = FusedDecodeProjections(F.linear)
    y = fused(x, w)
    assert torch.equal(y, fused_gemv(x, w))  # the fused route, not the composed one
    verdict = agreement(y, reference.linear(x.cpu(), w.cpu()), x, w)
    assert verdict.ok, str(verdict)
    for row in range(GEMV_MAX_ROWS):
        assert torch.equal(fused(x[row : row + 1], w), y[row : row + 1]), row
