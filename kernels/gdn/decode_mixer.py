"""A GDN layer's decode step between in_proj and out_proj in three Triton launches.

``kernels.reference.gdn_mixer`` with one token per sequence, as the model composes it on every other
step (the backend's conv, ``reference.gdn_gates``, the backend's delta rule, ``reference.gated_rms_norm``):

1. ``kernels/triton/gdn_conv_step.py``: the conv + SiLU of each row's qkv against its slot's conv
   state, the state shifted in place;
2. ``kernels/triton/gdn_decode.py`` with ``RAW_GATES``: g and β from the projection's a and b in the
   prologue, then the slot-indexed recurrent step;
3. ``kernels/triton/gdn_gated_norm.py``: the gated RMSNorm by z, per value head.

Each kernel gives a row the same bits alone as in any batch and at any row offset, reads zeros for
fresh rows without touching their slot, writes only its rows' slots (slot 0 is the padding slot that
CUDA-graph filler rows share), and needs nothing from the host: the step captures into a graph whose
grids the bucket's row count fixes. docs/kernels.md, "Gated DeltaNet", tells the story.

``DecodeMixer`` decides per step: steps where every row decodes one token (``StateRows.cu_seqlens``
is None) on CUDA or under the Triton interpreter run fused; any other step composes, its gates and
gated norm still through token-wise kernels (``DecodeMixer.gates``: the second kernel's prologue
on its own, kernels/triton/gdn_gates.py; ``DecodeMixer.gated_norm``: the third); every step of a
layer whose geometry or dtype a kernel refuses composes with the spec's torch ops, each reason
logged once by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.gdn.base import GDNGeometry, StateRows
from kernels.reference import SpecError, gated_rms_norm
from kernels.reference import gdn_gates as gdn_gates_spec
from kernels.triton.gdn_conv_step import check_conv_kernels, gdn_conv_step
from kernels.triton.gdn_decode import gdn_decode_step_with_gates
from kernels.triton.gdn_gated_norm import check_gated_norm, gdn_gated_norm
from kernels.triton.gdn_gates import gdn_gates
from kernels.triton.storage import interpreted

log = logging.getLogger("infer.kernels.gdn")

# The widest key head the decode kernel's [BLOCK_V, next_pow2(K)] fp32 state tile is sized for.
MAX_KEY_DIM = 256


class DecodeMixerError(SpecError):
    """A GDN layer the fused decode mixer does not take; the message names the value."""


@dataclass(frozen=True, slots=True)
class MixerWeights:
    """One GDN layer's weights between its projections: ``conv [D, W]``, ``a_log``, ``dt_bias
    [Hv]``, ``norm [V]``, and the norm's ``eps``."""

    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    eps: float


def check_decode_mixer(geometry: GDNGeometry, conv_width: int, dtype: torch.dtype) -> None:
    """Refuse, naming the value, what one of the three kernels does not take."""
    if geometry.key_dim > MAX_KEY_DIM:
        raise DecodeMixerError(
            f"key head dim {geometry.key_dim}: the fused decode step takes up to {MAX_KEY_DIM}"
        )
    channels = 2 * geometry.key_heads * geometry.key_dim + geometry.value_heads * geometry.value_dim
    check_conv_kernels(channels, conv_width, dtype)
    check_gated_norm(geometry.value_dim, dtype)


def gdn_decode_mixer(
    qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    weights: MixerWeights,
    geometry: GDNGeometry,
    rows: StateRows,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
) -> torch.Tensor:
    """One token per row: ``qkv [N, D]``, ``z [N, Hv·V]``, ``b, a [N, Hv]`` (column views of the input
    projection's output), the pools ``[slots, W − 1, D]`` and ``[slots, Hv, V, K]`` updated in place.
    Returns the output projection's input ``[N, Hv·V]``."""
    if rows.cu_seqlens is not None:
        raise DecodeMixerError(
            f"the fused decode step takes one token per row, got cu_seqlens {rows.cu_seqlens}"
        )
    g = geometry
    tokens = qkv.shape[0]
    mixed = gdn_conv_step(qkv, weights.conv, rows.slots, rows.fresh, conv_pool)
    key_width = g.key_heads * g.key_dim
    q, k, v = mixed.split([key_width, key_width, g.value_heads * g.value_dim], dim=-1)
    core = gdn_decode_step_with_gates(
        q.view(tokens, g.key_heads, g.key_dim),
        k.view(tokens, g.key_heads, g.key_dim),
        v.view(tokens, g.value_heads, g.value_dim),
        a,
        b,
        weights.a_log,
        weights.dt_bias,
        rows.slots,
        rows.fresh,
        state_pool,
    )
    return gdn_gated_norm(core, z.view(tokens, g.value_heads, g.value_dim), weights.norm, weights.eps)


class DecodeMixer:
    """Which steps of a GDN layer run ``gdn_decode_mixer``; each reason a step composes logged once."""

    def __init__(self, geometry: GDNGeometry, conv_width: int, dtype: torch.dtype) -> None:
        self.geometry = geometry
        self._logged: set[str] = set()
        self.refused: str | None = None
        try:
            check_decode_mixer(geometry, conv_width, dtype)
        except SpecError as exc:
            self.refused = str(exc)
            self._log_once(f"the GDN decode step composes on every step: {exc}")

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.info("GDN decode mixer: %s", message)

    def mix(
        self,
        qkv: torch.Tensor,
        z: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        weights: MixerWeights,
        rows: StateRows,
        conv_pool: torch.Tensor,
        state_pool: torch.Tensor,
    ) -> torch.Tensor:
        """``gdn_decode_mixer`` at this layer geometry, for a step ``runs`` took."""
        return gdn_decode_mixer(qkv, z, b, a, weights, self.geometry, rows, conv_pool, state_pool)

    def gates(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``reference.gdn_gates`` of a step that composes (a prefill's tokens): the decode step's
        prologue as its own token-wise launch (kernels/triton/gdn_gates.py), unless this layer was
        refused."""
        if self.refused is not None:
            return gdn_gates_spec(a, b, a_log, dt_bias)
        return gdn_gates(a, b, a_log, dt_bias)

    def gated_norm(
        self, core: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """The gated RMSNorm of a step that composes: the third kernel, which works token by token so
        any step takes it, unless this layer was refused."""
        if self.refused is not None:
            return gated_rms_norm(core, gate, weight, eps)
        return gdn_gated_norm(core, gate, weight, eps)

    def runs(self, rows: StateRows, device: torch.device) -> bool:
        """Whether this step runs fused: every row one token, on CUDA (or the interpreter), a layer
        the kernels take. Decided from host facts only (no device read)."""
        if self.refused is not None:
            return False
        if device.type != "cuda" and not interpreted():
            self._log_once(f"the GDN decode step composes on {device}: the kernels need CUDA")
            return False
        if rows.cu_seqlens is not None:
            self._log_once("the GDN mixer composes on steps with a prefill row (more than one token)")
            return False
        return True
