"""How far a fused decode kernel (``fused_gemv``, ``fused_mma``) may sit from its spec
(``reference.norm_linear`` / ``linear_residual`` / ``linear_gated``), built from what the spec's own
freedoms cost, measured in the same run by the tests that use these helpers:

* the linear's fp32 sum order: ``linear_bounds.py`` (per element ``16·u·Σ|x w| + ulp_S``, at most 8×
  the measured share of flipped elements);
* the norm's sum-of-squares order: ``norm_order_flips`` runs the spec on the hidden rows with their
  columns permuted (so the squares are added in other orders); the tests require it to move no
  bf16/fp16 normalised element on their operands, so the linear bound holds unchanged; where a test
  compares a fused norm with ``invariant_rms_norm`` bit for bit, ``order_free_rows`` gives it rows
  whose sum of squares no order can move;
* the gated epilogue: ``gated_allowed``, per element how far the spec moves when each rounded
  projection output moves by the linear bound (the spec itself evaluated at the perturbed gate and
  up), plus the envelope of exp's last fp32 bit from ``test_gated_act.py``.
"""

from __future__ import annotations

import itertools
import math

import torch
from linear_bounds import FP32_RATIO_BOUND, U32, magnitude_sums, ulp

from kernels import reference
from kernels.reference import GatedActivation, NormSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Share of bf16 elements where exp's or tanh's last fp32 bit may flip the activation's rounding:
# at most 1 % on the GPU (libdevice, test_gated_act.py); the interpreter's tanh is a formula in exp,
# 96 % the spec's bits there (test_gated_act.py), 92.5-96.3 % on the GEMV tests' operands.
TRANSCENDENTAL_SHARE = 0.01 if DEVICE == "cuda" else 0.08


def linear_allowed(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """linear_bounds' per-element bound for ``x @ w.T`` at the spec's rounded result ``y`` (fp64)."""
    allowed = FP32_RATIO_BOUND * U32 * magnitude_sums(x.cpu(), w.cpu())
    return allowed + (ulp(y.cpu(), y.dtype) if y.dtype != torch.float32 else 0.0)


def check_within(got: torch.Tensor, want: torch.Tensor, allowed: torch.Tensor, share: float) -> None:
    """Every element within ``allowed`` of the spec, and at most ``⌈share · elements⌉`` differing."""
    delta = (got.cpu().double() - want.cpu().double()).abs()
    worst = torch.where(delta == 0, 0.0, delta / allowed).max().item()
    differing = int((got.cpu() != want.cpu()).sum())
    most = math.ceil(share * got.numel())
    assert worst <= 1.0 and differing <= most, (
        f"worst |Δ| at {worst:.3g}× the bound; {differing} of {got.numel()} differ (at most {most})"
    )


def order_free_rows(m: int, k: int, dtype: torch.dtype, *, seed: int = 5) -> torch.Tensor:
    """Hidden rows whose fp32 sum of squares is exact in every order, on ``DEVICE``.

    The elements are multiples of 1/8 in [-4, 4] (exact in bf16, fp16 and fp32), so every square is
    a multiple of 1/64 at most 16 and every partial sum of K ≤ 16,384 of them fits fp32's 24 bits. A
    fused norm prologue and ``invariant_rms_norm`` may add the squares in different orders (their
    reductions have different layouts); on these rows that freedom is gone and their bits must match.
    """
    g = torch.Generator().manual_seed(seed + k + 1000 * m)
    rows = torch.randint(-32, 33, (m, k), generator=g).to(torch.float64) / 8
    squares = rows.square().sum(-1)
    assert k <= 16_384 and torch.equal(squares.float().double(), squares), "not exact in fp32"
    return rows.to(dtype).to(DEVICE)


def norm_order_flips(h: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None) -> int:
    """Normalised elements that change when the spec sums the squares in other column orders."""
    spec_rows = reference.rms_norm(h.cpu(), spec, None if weight is None else weight.cpu())
    flips = 0
    for seed in range(3):
        perm = torch.randperm(h.shape[-1], generator=torch.Generator().manual_seed(seed))
        permuted = reference.rms_norm(h.cpu()[:, perm], spec, None if weight is None else weight.cpu()[perm])
        flips += int((permuted[:, torch.argsort(perm)] != spec_rows).sum())
    return flips


def gated_allowed(x: torch.Tensor, gate_up: torch.Tensor, kind: GatedActivation) -> torch.Tensor:
    """Per element: the spec's largest move when its rounded gate and up move by the linear bound,
    plus exp's last-bit envelope (test_gated_act.py)."""
    x, gate_up = x.cpu(), gate_up.cpu()
    projected = reference.linear(x, gate_up)
    want = reference.gated_activation(projected, kind).double()
    step = linear_allowed(x, gate_up, projected)
    worst = torch.zeros_like(want)
    for signs in itertools.product((-1.0, 0.0, 1.0), repeat=2):
        factor = torch.cat([torch.full_like(want, signs[0]), torch.full_like(want, signs[1])], dim=-1)
        moved = (projected.double() + factor * step).to(projected.dtype)
        worst = torch.maximum(worst, (reference.gated_activation(moved, kind).double() - want).abs())
    gate, up = projected.double().chunk(2, dim=-1)
    act = reference.gated_activation(torch.cat([gate, torch.ones_like(up)], -1), kind)
    dtype = projected.dtype
    return worst + (2.0**-23 * gate.abs() + ulp(act, dtype)) * up.abs() + ulp(want, dtype)


def norm_linear_allowed(
    h: torch.Tensor, spec: NormSpec, norm_weight: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Per element bound and extra flip share for ``reference.norm_linear`` when the kernel sums the
    squares in its own order (the one freedom the norm leaves).

    Measured on the operands: the spec with its squares summed in 3 other orders (``norm_order_flips``'
    permutations). Each moved normalised element must move by at most one storage ulp (asserted);
    ``F`` = the most elements one row saw move (at least 1). Per element: the linear's reordering
    bound at the spec's normalised rows plus, for bf16/fp16, ``F`` such moves at the row's largest
    ``ulp(n_k)·|w_k|`` (fp32 moves are fp32 ulps, inside the linear bound's ``16·u·Σ|x w|``). Share:
    every element of a row in which a permutation moved a normalised element may differ."""
    h, weight = h.cpu(), weight.cpu()
    nw = None if norm_weight is None else norm_weight.cpu()
    normed = reference.rms_norm(h, spec, nw)
    allowed = linear_allowed(normed, weight, reference.linear(normed, weight))
    if normed.dtype == torch.float32:
        return allowed, 0.0
    per_row = torch.zeros(h.shape[0], dtype=torch.long)
    for seed in range(3):
        perm = torch.randperm(h.shape[-1], generator=torch.Generator().manual_seed(seed))
        permuted = reference.rms_norm(h[:, perm], spec, None if nw is None else nw[perm])[
            :, torch.argsort(perm)
        ]
        moved = (permuted.double() - normed.double()).abs()
        assert bool((moved <= ulp(normed, normed.dtype)).all()), (
            "a sum-of-squares order moved a value > 1 ulp"
        )
        per_row = torch.maximum(per_row, (moved > 0).sum(dim=1))
    steps = max(1, int(per_row.max()))
    magnitudes, steps_k = weight.double().abs(), ulp(normed, normed.dtype)
    one_move = torch.stack(
        [(row[None, :] * magnitudes).amax(dim=-1) for row in steps_k]
    )  # row by row: [N, K]
    return allowed + steps * one_move, int((per_row > 0).sum()) / h.shape[0]
