"""The decoder layer Gemma 3 and Gemma 4 share around their attention: QKV → the line's attention →
O → residual step → gate/up with GELU-tanh·mul → down → residual step.

Each residual step is one ``layer_ops.add_rms_norm``: the post-attention norm of the delta, the add
and the pre-feedforward norm; then the post-feedforward norm of the delta, the add, the layer scalar
(Gemma 4; none on Gemma 3) and the next norm (the next layer's input norm, or the final norm). The
post-norms read the whole delta row, so they cannot move into a projection's epilogue.

Every projection goes through the model's ``Projections`` (``kernels.gemm.projections``): composed,
the policy's linear and ``layer_ops.gated_activation``; on a step the fused projections take
(``--decode-fusion``, docs/kernels.md "The fused decode GEMV"), QKV, O and down as the fused GEMV's
plain variant and gate/up with its GELU-tanh epilogue. Under tensor parallelism O and down are
row-parallel: ``reduce`` (the all-reduce) runs before the residual step that reads their sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kernels import layer_ops
from kernels.gemm.projections import Projections
from kernels.reference import GatedActivation, NormSpec


class GemmaLayerWeights(Protocol):
    """The tensors of one Gemma layer the shared step reads (the attention's own stay with the line)."""

    @property
    def qkv(self) -> torch.Tensor: ...
    @property
    def o(self) -> torch.Tensor: ...
    @property
    def post_attention_norm(self) -> torch.Tensor: ...
    @property
    def pre_feedforward_norm(self) -> torch.Tensor: ...
    @property
    def post_feedforward_norm(self) -> torch.Tensor: ...
    @property
    def gate_up(self) -> torch.Tensor: ...  # [2 * intermediate, hidden]
    @property
    def down(self) -> torch.Tensor: ...


def gemma_layer(
    projections: Projections,
    layer: GemmaLayerWeights,
    hidden: torch.Tensor,
    x: torch.Tensor,
    attend: Callable[[torch.Tensor], torch.Tensor],
    *,
    norm: NormSpec,
    next_norm: torch.Tensor,
    scale: torch.Tensor | None,
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer over the residual stream ``hidden`` and its input norm ``x``: the new residual and
    its ``next_norm``. ``attend`` maps the QKV projection's output to O's input ([tokens, q_size])."""
    attn_out = reduce(projections(attend(projections(x, layer.qkv)), layer.o))
    hidden, x = layer_ops.add_rms_norm(
        hidden, attn_out, norm, layer.pre_feedforward_norm, delta_weight=layer.post_attention_norm
    )
    activated = projections.norm_linear_gated(x, None, None, layer.gate_up, GatedActivation.GELU_TANH)
    mlp_out = reduce(projections(activated, layer.down))
    return layer_ops.add_rms_norm(
        hidden, mlp_out, norm, next_norm, delta_weight=layer.post_feedforward_norm, scale=scale
    )
