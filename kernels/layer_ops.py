"""The residual stream's norms and the gated MLP activation for a device: the fused Triton kernels on
CUDA, the spec itself (kernels.reference) elsewhere, so CPU runs and tests keep computing the
definition. Every numeric policy runs these: each row is normalised (or activated) by its own
program with a tile set by the hidden size alone, so they are batch-invariant by construction and
need no policy switch (docs/numerics.md).

``add_rms_norm`` is a residual step and the norm that reads its sum, ``reference.add_rms_norm``:
the delta (normalised first for Gemma 4's post-attention and post-feedforward norms), the add,
Gemma 4's layer scalar and the norm in one launch, instead of one torch kernel per op and fp32 cast.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.reference import GatedActivation, NormSpec


def _on_triton(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def rms_norm(x: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` over its last dim, in ``x.dtype`` (``reference.rms_norm``'s rounding)."""
    if not _on_triton(x):
        return reference.rms_norm(x, spec, weight)
    from kernels.triton.invariant_rmsnorm import invariant_rms_norm

    return invariant_rms_norm(x, spec, weight)


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor,
    spec: NormSpec,
    weight: torch.Tensor | None = None,
    *,
    delta_weight: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.add_rms_norm``: the new residual and its norm, both in the storage dtype.

    The residual is not modified; the sum is a new tensor, as with torch's ``+``.
    """
    if not _on_triton(residual):
        return reference.add_rms_norm(residual, delta, spec, weight, delta_weight=delta_weight, scale=scale)
    from kernels.triton.invariant_rmsnorm import invariant_add_rms_norm

    return invariant_add_rms_norm(residual, delta, spec, weight, delta_weight=delta_weight, scale=scale)


def gated_activation(gate_up: torch.Tensor, kind: GatedActivation) -> torch.Tensor:
    """``reference.gated_activation``: ``act(gate) · up`` of the fused gate/up projection's output."""
    if not _on_triton(gate_up):
        return reference.gated_activation(gate_up, kind)
    from kernels.triton.gated_act import gated_act

    return gated_act(gate_up, kind)
