"""Chooses the RMSNorm implementation for a device: the batch-invariant Triton kernel on CUDA, the
spec itself (kernels.reference) elsewhere, so CPU runs and tests keep computing the definition.

``add_rms_norm`` is the residual-stream step ``s = residual + delta; x = rms_norm(s)``. Its definition
is exactly that composition of torch's add (in the storage dtype) and ``reference.rms_norm``; on CUDA
one kernel launch computes both outputs with the same rounding points instead of three or more
torch kernels.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.reference import NormSpec


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
        if delta.shape != residual.shape or delta.dtype != residual.dtype:
            # torch would broadcast or promote here; the fused kernel does neither, so neither may this.
            raise reference.SpecError(
                f"delta is {tuple(delta.shape)} {delta.dtype}, residual {tuple(residual.shape)} {residual.dtype}"
            )
        summed = residual + delta
        return summed, reference.rms_norm(summed, spec, weight)
    from kernels.triton.invariant_rmsnorm import invariant_add_rms_norm

    return invariant_add_rms_norm(residual, delta, spec, weight)
