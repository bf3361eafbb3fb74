"""How far a GEMM kernel may sit from ``kernels.reference.linear``, and where that figure comes from.

The spec leaves a kernel one freedom: the order of the fp32 sum over K (``reference.linear``). So the
tolerance is what reordering that sum costs, measured on the spec itself, with a margin.

Measured by ``python tests/kernels/linear_bounds.py`` (torch 2.13 CPU): M = 64 rows, [N, K] from
[40, 80] to [128, 9728] (``MEASURED_SHAPES``), 2-4 seeds each, the test operands' distribution
(x ~ N(0, 1), w ~ N(0, 1/K)), bf16/fp16/fp32. The spec's fp32 result against the same products
summed K-reversed, in K chunks of 16/64/512 added in order, and one by one left to right:

* in fp32, ``|Δ| / (u · Σ_k |x_k w_k|)`` (u = 2⁻²⁴; the sum of magnitudes is the condition of the
  sum) reached **5.41** at worst (fp16 operands, [40, 208]); 2.9 at worst for bf16 operands.
* after rounding to storage, the share of elements whose rounded value changed reached **0.098 %**
  in bf16 and **0.85 %** in fp16 (both at K = 9728, summed one by one); fp32 outputs differ at
  88-98 % of elements.

Bounds: per element ``|y − spec| ≤ 16 · u · Σ|x w| + ulp_S(max(|y|, |spec|))`` (about 3× the worst
reordering, plus one rounding step of the storage dtype where the two fp32 sums straddle a rounding
point), and at most ``⌈share · elements⌉`` elements differing at all, share = 8× the measured worst
(0.8 % bf16, 6.9 % fp16, any for fp32). Neither says what the kernel *does* differ by (under the
interpreter, usually nothing); they say what a correct kernel may not exceed. A kernel that rounds
anything to storage before the end, truncates instead of rounding, or drops a K tile breaks one.

``test_skinny_gemm.py::test_the_bound_is_what_reordering_the_spec_costs`` re-measures on the test
shapes, so a change to the spec or the operands that invalidates these figures fails there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference

U32 = 2.0**-24
# Worst measured reordering, in units of u · Σ|x w| (module doc), and the bound built from it.
MEASURED_REORDER_RATIO = 5.5
FP32_RATIO_BOUND = 16.0
# Worst measured share of elements whose rounding flipped under reordering, and the bounds (8×).
MEASURED_FLIP_SHARE = {torch.bfloat16: 0.001, torch.float16: 0.0086}
FLIP_SHARE_BOUND = {torch.bfloat16: 0.008, torch.float16: 0.069, torch.float32: 1.0}
# Where the figures were measured: M = 64 rows, these [N, K].
MEASURED_SHAPES = ((40, 80), (40, 208), (40, 256), (64, 640), (256, 2560), (128, 9728))
# Significand bits (with the implicit one) of each storage dtype: ulp(t) = 2^(⌊log2 t⌋ + 1 − bits).
_SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
_SMALLEST_NORMAL = {dtype: torch.finfo(dtype).tiny for dtype in _SIGNIFICAND_BITS}


def magnitude_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``Σ_k |x_k| |w_k|`` per output element, in fp64 (the scale of any fp32 reordering error)."""
    return x.double().abs() @ weight.double().abs().T


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at magnitude ``|t|`` (subnormal spacing below normal)."""
    magnitude = t.double().abs().clamp_min(_SMALLEST_NORMAL[dtype])
    return torch.exp2(torch.floor(torch.log2(magnitude)) + 1 - _SIGNIFICAND_BITS[dtype])


@dataclass(frozen=True, slots=True)
class Agreement:
    """How two results of the same linear differ, judged by the bounds above."""

    worst_excess: float  # max of |Δ| / allowed over elements; ≤ 1 passes
    differing: int
    allowed_differing: int
    elements: int

    @property
    def ok(self) -> bool:
        return self.worst_excess <= 1.0 and self.differing <= self.allowed_differing

    def __str__(self) -> str:
        return (
            f"worst |Δ| at {self.worst_excess:.3g}× the bound; {self.differing} of {self.elements} "
            f"elements differ (at most {self.allowed_differing} allowed)"
        )


def agreement(y: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> Agreement:
    """``y`` against ``expected`` (the spec, or another order of the same sum) for ``x @ weight.T``."""
    dtype = expected.dtype
    y_, e_ = y.double().cpu(), expected.double().cpu()
    allowed = FP32_RATIO_BOUND * U32 * magnitude_sums(x.cpu(), weight.cpu())
    allowed = allowed + (ulp(torch.maximum(y_.abs(), e_.abs()), dtype) if dtype != torch.float32 else 0.0)
    delta = (y_ - e_).abs()
    excess = torch.where(delta == 0, 0.0, delta / allowed).max().item() if y.numel() else 0.0
    differing = int((y.cpu() != expected.cpu()).sum().item())
    share = math.ceil(FLIP_SHARE_BOUND[dtype] * y.numel())
    return Agreement(excess, differing, share, y.numel())


def reorderings(x: torch.Tensor, weight: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The spec's fp32 products summed in other orders (fp32 results, not rounded to storage)."""
    xf, wf = x.float(), weight.float()
    yield "K reversed", F.linear(xf.flip(-1), wf.flip(-1))
    for chunk in (16, 64, 512):
        acc = torch.zeros(x.shape[0], weight.shape[0])
        for k0 in range(0, x.shape[1], chunk):
            acc = acc + F.linear(xf[:, k0 : k0 + chunk], wf[:, k0 : k0 + chunk])
        yield f"chunks of {chunk}", acc
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xf[:, k : k + 1] * wf[:, k][None, :]
    yield "one by one", acc


@dataclass(frozen=True, slots=True)
class ReorderMeasurement:
    ratio: float  # worst |Δ| / (u · Σ|x w|) in fp32
    flip_share: float  # worst share of elements whose rounding to storage changed


def measure_reordering(x: torch.Tensor, weight: torch.Tensor) -> ReorderMeasurement:
    """What summing the spec in other orders costs on these operands (module doc)."""
    spec32 = F.linear(x.float(), weight.float()).double()
    spec = reference.linear(x, weight)
    scale = U32 * magnitude_sums(x, weight)
    ratio, share = 0.0, 0.0
    for _, other in reorderings(x, weight):
        ratio = max(ratio, ((other.double() - spec32).abs() / scale).max().item())
        share = max(share, (other.to(x.dtype) != spec).double().mean().item())
    return ReorderMeasurement(ratio, share)


def main() -> None:
    """Re-measure the figures of the module doc."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        worst = ReorderMeasurement(0.0, 0.0)
        for n, k in MEASURED_SHAPES:
            for seed in range(4 if k < 2000 else 2):
                g = torch.Generator().manual_seed(seed + 3)
                x = torch.randn(64, k, generator=g).to(dtype)
                w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
                got = measure_reordering(x, w)
                print(
                    f"{dtype} [{n}, {k}] seed {seed + 3}: ratio {got.ratio:.2f}, flips {got.flip_share:.5f}"
                )
                worst = ReorderMeasurement(max(worst.ratio, got.ratio), max(worst.flip_share, got.flip_share))
        print(f"{dtype} worst: ratio {worst.ratio:.2f}, flips {100 * worst.flip_share:.3f} %")


if __name__ == "__main__":
    main()
