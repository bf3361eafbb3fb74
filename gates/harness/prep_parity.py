"""How close a prep kernel must be to ``kernels.reference``, and the checks that say so.

Derivation of the tolerance. The kernel and the spec round at the same points and read cos/sin
from the same table, so the only freedom left is the order of the fp32 sum in ``mean(x²)``. That
moves ``1/rms`` by a few fp32 ulps (relative ~2⁻²²), which flips the rounding of a normalised value
to its neighbour only when it lies that close to a rounding boundary: for bf16 about one element
in 2¹⁴. A flip moves that value by one ulp u. Through the rotation ``R(R(a·c) ∓ R(b·s))`` with
|c|, |s| ≤ 1 the output moves by at most u, plus one re-rounding of each product and of the sum;
measured in ulps of the head's largest output (a rotation keeps each pair's length, so the largest
input is at most √2 times that), this stays within 4. So:

- bf16: every element within 4 ulps of its head's largest magnitude, and at most 2⁻¹⁰ of the
  elements different at all (~16× the expected rate). A kernel with other rounding points (e.g.
  one rounding at the end) mismatches about a quarter of the elements, and a pairing or slot
  error gives errors of the size of the values themselves;
- fp16 (3 more mantissa bits, so 8× more flips): 4 ulps, at most 2⁻⁷ different;
- fp32: every rounding is as fine as the sum's own error, so whole heads may differ in the last
  bits: 16 ulps, no limit on how many differ;
- copies (the output gate, an un-normed V, pool slots the batch does not address) are bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class Tolerance:
    max_ulps: float
    max_mismatch_fraction: float


TOLERANCES = {
    torch.bfloat16: Tolerance(max_ulps=4.0, max_mismatch_fraction=2.0**-10),
    torch.float16: Tolerance(max_ulps=4.0, max_mismatch_fraction=2.0**-7),
    torch.float32: Tolerance(max_ulps=16.0, max_mismatch_fraction=1.0),
}
EXACT = Tolerance(max_ulps=0.0, max_mismatch_fraction=0.0)

_BIT_VIEWS = {2: torch.int16, 4: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the two tensors hold identical bit patterns (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"cannot compare {a.dtype}{tuple(a.shape)} with {b.dtype}{tuple(b.shape)}")
    view = _BIT_VIEWS[a.element_size()]
    return a.contiguous().view(view) == b.contiguous().view(view)


def bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(same_bits(a, b).all())


@dataclass(slots=True, frozen=True)
class ParityReport:
    """One output compared with the spec."""

    name: str
    dtype: torch.dtype
    elements: int
    mismatched: int
    worst_ulps: float

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatched / self.elements if self.elements else 0.0

    def failure(self, tolerance: Tolerance | None = None) -> str | None:
        """A sentence saying what is out of tolerance (the dtype's by default), or None."""
        limits = TOLERANCES[self.dtype] if tolerance is None else tolerance
        if self.worst_ulps > limits.max_ulps:
            return f"{self.name}: an element is {self.worst_ulps:.3g} head-ulps from the spec (limit {limits.max_ulps})"
        if self.mismatch_fraction > limits.max_mismatch_fraction:
            return (
                f"{self.name}: {self.mismatched} of {self.elements} elements differ from the spec "
                f"({self.mismatch_fraction:.3g}, limit {limits.max_mismatch_fraction:.3g})"
            )
        return None


def compare_heads(name: str, actual: torch.Tensor, expected: torch.Tensor) -> ParityReport:
    """Compare along the last dim (one head); ulps are those of each head's largest |expected|."""
    differ = ~same_bits(actual, expected)
    a = actual.to(torch.float32)
    e = expected.to(torch.float32)
    head_max = e.abs().amax(dim=-1, keepdim=True)
    tiny = torch.finfo(expected.dtype).tiny
    ulp = torch.finfo(expected.dtype).eps * torch.exp2(torch.floor(torch.log2(head_max.clamp_min(tiny))))
    error = (a - e).abs() / ulp
    # A NaN on one side only is as far as it gets; NaN against NaN is judged by the bit check.
    error = torch.where(torch.isnan(a) & torch.isnan(e), torch.zeros_like(error), error)
    error = torch.nan_to_num(error, nan=float("inf"))
    worst = float(error.max()) if error.numel() else 0.0
    return ParityReport(
        name=name,
        dtype=expected.dtype,
        elements=actual.numel(),
        mismatched=int(differ.sum()),
        worst_ulps=worst,
    )


def unaddressed_unchanged(
    before_layer: torch.Tensor, after_layer: torch.Tensor, addressed: torch.Tensor
) -> bool:
    """Every slot of a pool layer outside ``addressed [pages, 16]`` kept its bits (K and V)."""
    untouched = ~addressed
    unchanged = same_bits(before_layer, after_layer).flatten(start_dim=3).all(dim=-1)  # [pages, 2, 16]
    return bool(unchanged[:, 0][untouched].all() and unchanged[:, 1][untouched].all())
