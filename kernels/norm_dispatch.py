"""Chooses the RMSNorm implementation for a device: the batch-invariant Triton kernel on CUDA, the
spec itself (kernels.reference) elsewhere, so CPU runs and tests keep computing the definition.

``add_rms_norm`` is the residual-stream step ``s = residual + delta; x = rms_norm(s)``. Its definition
is exactly that composition of torch's add (in the storage dtype) and ``reference.rms_norm``; on CUDA
one kernel launch computes both outputs with the same rounding points instead of three or more
torch kernels.

``policy_norms(policy)`` is what a model line hands its model, the way ``policy_linear`` hands it a
linear: under the end-to-end invariant policies (``invariant``, ``per-token``) these dispatching
norms; under ``tuned`` and ``pin`` the spec's torch ops on every device (docs/numerics.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import reference
from kernels.gemm.names import NumericPolicy, is_end_to_end_invariant
from kernels.reference import NormSpec

RmsNorm = Callable[[torch.Tensor, NormSpec, torch.Tensor | None], torch.Tensor]
AddRmsNorm = Callable[
    [torch.Tensor, torch.Tensor, NormSpec, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]


def _on_triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def rms_norm(x: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` over its last dim, in ``x.dtype`` (``reference.rms_norm``'s rounding)."""
    if not _on_triton(x):
        return reference.rms_norm(x, spec, weight)
    from kernels.triton.invariant_rmsnorm import invariant_rms_norm

    return invariant_rms_norm(x, spec, weight)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + delta, rms_norm(residual + delta, spec, weight))``, both in the storage dtype.

    The residual is not modified; the sum is a new tensor, as with torch's ``+``.
    """
    if not _on_triton(residual):
        return reference_add_rms_norm(residual, delta, spec, weight)
    from kernels.triton.invariant_rmsnorm import invariant_add_rms_norm

    return invariant_add_rms_norm(residual, delta, spec, weight)


def reference_add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of ``add_rms_norm`` in torch ops on any device: torch's add, then the spec."""
    if delta.shape != residual.shape or delta.dtype != residual.dtype:
        # torch would broadcast or promote here; the fused kernel does neither, so neither may this.
        raise reference.SpecError(
            f"delta is {tuple(delta.shape)} {delta.dtype}, residual {tuple(residual.shape)} {residual.dtype}"
        )
    summed = residual + delta
    return summed, reference.rms_norm(summed, spec, weight)


@dataclass(frozen=True, slots=True)
class NormOps:
    """The two norm steps a model's forward takes: a plain RMSNorm and the residual-add RMSNorm."""

    rms_norm: RmsNorm
    add_rms_norm: AddRmsNorm


# The spec's torch ops on every device (tuned, pin).
REFERENCE_NORMS = NormOps(reference.rms_norm, reference_add_rms_norm)
# The batch-invariant Triton kernels on CUDA, the spec elsewhere.
DISPATCHED_NORMS = NormOps(rms_norm, add_rms_norm)


def policy_norms(policy: NumericPolicy | str) -> NormOps:
    """The norms of a numeric policy: dispatched (batch-invariant) under `invariant` and `per-token`."""
    return DISPATCHED_NORMS if is_end_to_end_invariant(policy) else REFERENCE_NORMS
