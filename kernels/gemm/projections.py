"""The projections a model layer calls, with their neighbouring ops: the seam between a model's
forward and the fused decode GEMV (docs/kernels.md, "The fused decode GEMV").

A ``Projections`` is the policy's ``linear`` (it is called as one: ``projections(x, weight)``) plus
three fused ops, each defined in ``kernels.reference``:

* ``norm_linear(h, spec, norm_weight, weight)``: a layer's input norm and its projection;
* ``linear_residual(x, weight, residual, reduce)``: a projection added to the residual stream;
  ``reduce`` (tensor parallelism's all-reduce of the partial sums) runs before the add;
* ``norm_linear_gated(h, spec, norm_weight, weight, kind)``: the gate/up projection and the gated
  activation, optionally with the norm before it (``spec=None``: no norm).

``ComposedProjections`` runs each as separate ops (the policy's linear, ``layer_ops.rms_norm``,
torch's rounded add, ``layer_ops.gated_activation``), with one exception: where the policy's linear
is the ``tuned`` dispatch and its table sends the gate/up weight at this M to the decode GEMV (at
one row: ``skinny_dispatch.GATED_MAX_ROWS``), the GEMV's gated epilogue stores ``act(gate) · up`` itself (``SkinnyDispatch.linear_gated``: one launch a
layer fewer, Qwen3-4B's batch-1 step 0.07 ms faster on an H100, docs/benchmarks/qwen3.md).
``FusedDecodeProjections`` runs each of them, and the plain projection ``projections(x, weight)``
(the LM head included: the fused kernels' weight offsets are 64-bit), as one fused launch when
``fuses(rows, device)`` (steps of at most ``fused_mma.MAX_ROWS`` rows, on CUDA or under the Triton
interpreter) and the shape is one the kernel takes: the fused GEMV up to ``fused_gemv.MAX_ROWS``
rows, the fused MMA (tensor cores) above; anything else composes, a shape the kernel refuses logged
once by name. Under tensor parallelism the residual cannot be fused (the partial sums meet in the
reduce first): given a ``reduce``, ``linear_residual`` composes.

Only the ``tuned`` policy takes the fused path (``policy_projections``): ``invariant``, ``pin`` and
``per-token`` promise one kernel for every row count, which a decode-only kernel would break.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kernels import layer_ops, reference
from kernels.gemm.dispatch import Linear
from kernels.gemm.names import NumericPolicy, parse_policy
from kernels.gemm.skinny_dispatch import SkinnyDispatch
from kernels.reference import GatedActivation, NormSpec, NormWeight
from kernels.triton.storage import interpreted

log = logging.getLogger("infer.gemm")

Reduce = Callable[[torch.Tensor], torch.Tensor]

_NO_NORM = NormSpec(NormWeight.NONE)


class ComposedProjections:
    """Every op as the unfused kernels the forward composes; ``fuses`` is never true."""

    def __init__(self, linear: Linear) -> None:
        self.linear = linear

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(x, weight)

    def fuses(self, rows: int, device: torch.device) -> bool:
        """Whether a step of ``rows`` token rows on ``device`` runs the fused ops as one launch each."""
        return False

    def norm_linear(
        self, h: torch.Tensor, spec: NormSpec, norm_weight: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        return self.linear(layer_ops.rms_norm(h, spec, norm_weight), weight)

    def linear_residual(
        self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, reduce: Reduce | None = None
    ) -> torch.Tensor:
        delta = self.linear(x, weight)
        return reference.residual_add(residual, delta if reduce is None else reduce(delta), _NO_NORM)

    def norm_linear_gated(
        self,
        h: torch.Tensor,
        spec: NormSpec | None,
        norm_weight: torch.Tensor | None,
        weight: torch.Tensor,
        kind: GatedActivation,
    ) -> torch.Tensor:
        x = h if spec is None else layer_ops.rms_norm(h, spec, norm_weight)
        if isinstance(self.linear, SkinnyDispatch):
            fused = self.linear.linear_gated(x, weight, kind)
            if fused is not None:
                return fused
        return layer_ops.gated_activation(self.linear(x, weight), kind)


class FusedDecodeProjections(ComposedProjections):
    """Decode steps (``fuses``) through the fused decode kernels, one launch per op; the rest composed."""

    def __init__(self, linear: Linear) -> None:
        super().__init__(linear)
        self._logged: set[tuple[str, int, int, str]] = set()

    def fuses(self, rows: int, device: torch.device) -> bool:
        from kernels.triton.fused_mma import MAX_ROWS

        return 0 < rows <= MAX_ROWS and (device.type == "cuda" or interpreted())

    def _fused(
        self,
        op: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        *,
        norm: NormSpec | None = None,
        activation: GatedActivation | None = None,
        norm_weight: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One fused launch where the step and shape are covered: the GEMV (CUDA cores) up to its
        ``MAX_ROWS``, the MMA (tensor cores) above, both computing the same fusion (docs/kernels.md);
        None where the step is not fused, or, logged once per op and weight shape, where the kernel
        refuses the shape."""
        # The kernel modules import Triton: loaded on a fused step only, and looked up by module so
        # a test's spy on a launch function sees every call.
        from kernels.triton import fused_gemv, fused_mma

        if x.dim() != 2 or not self.fuses(x.shape[0], x.device):
            return None
        fusion = fused_gemv.Fusion(norm=norm, residual=residual is not None, activation=activation)
        launch = fused_gemv.fused_gemv if x.shape[0] <= fused_gemv.MAX_ROWS else fused_mma.fused_mma
        try:
            return launch(x, weight, fusion, norm_weight=norm_weight, residual=residual)
        except (fused_gemv.FusedGemvError, fused_mma.FusedMmaError) as exc:
            key = (op, int(weight.shape[0]), int(weight.shape[-1]), str(weight.dtype))
            if key not in self._logged:
                self._logged.add(key)
                log.warning(
                    "fused decode kernel: %s over weight %s composes: %s", op, list(weight.shape), exc
                )
            return None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = self._fused("linear", x, weight)
        return super().__call__(x, weight) if y is None else y

    def norm_linear(
        self, h: torch.Tensor, spec: NormSpec, norm_weight: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        y = self._fused("norm_linear", h, weight, norm=spec, norm_weight=norm_weight)
        return super().norm_linear(h, spec, norm_weight, weight) if y is None else y

    def linear_residual(
        self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, reduce: Reduce | None = None
    ) -> torch.Tensor:
        # With a reduce the partial sums must meet before the add: that composes.
        y = None if reduce is not None else self._fused("linear_residual", x, weight, residual=residual)
        return super().linear_residual(x, weight, residual, reduce) if y is None else y

    def norm_linear_gated(
        self,
        h: torch.Tensor,
        spec: NormSpec | None,
        norm_weight: torch.Tensor | None,
        weight: torch.Tensor,
        kind: GatedActivation,
    ) -> torch.Tensor:
        y = self._fused("norm_linear_gated", h, weight, norm=spec, activation=kind, norm_weight=norm_weight)
        return super().norm_linear_gated(h, spec, norm_weight, weight, kind) if y is None else y


Projections = ComposedProjections


def as_projections(linear: Linear) -> Projections:
    """The projections a model calls: `linear` itself when the loader already built them
    (`policy_projections`), else the policy's linear composed."""
    return linear if isinstance(linear, ComposedProjections) else ComposedProjections(linear)


def policy_projections(
    policy: NumericPolicy | str, device: torch.device, linear: Linear, *, decode_fusion: bool
) -> Projections:
    """The projections a model builds on: ``FusedDecodeProjections`` when ``decode_fusion`` is asked
    for under ``tuned`` on CUDA (or the Triton interpreter), ``ComposedProjections`` otherwise; a
    request the policy or device rules out is logged by name."""
    chosen = parse_policy(policy) if isinstance(policy, str) else policy
    if not decode_fusion:
        return ComposedProjections(linear)
    if chosen is not NumericPolicy.TUNED:
        log.info(
            "--decode-fusion: policy %s promises one kernel for every row count; projections compose",
            chosen.value,
        )
        return ComposedProjections(linear)
    if device.type != "cuda" and not interpreted():
        log.info("--decode-fusion: %s has no Triton kernels (CUDA only); projections compose", device)
        return ComposedProjections(linear)
    return FusedDecodeProjections(linear)
