"""The `flashinfer` GDN backend: FlashInfer's SM90 CuTe-DSL chunked prefill
(``flashinfer.gdn_prefill.chunk_gated_delta_rule``), our slot-indexed Triton kernel for decode.

Written from flashinfer-python 0.7.2.post1's source (the wheel the device stages) and not yet run:
unverified until the `gdn_backends_agree` gate passes on the H200.

What the call relies on, as that source states it:
- q, k, v ``[T, H, 128]`` bf16 or fp16, contiguous; ``cu_seqlens`` int64 on the device; the SM90
  kernel takes head size 128 only.
- ``g`` is the per-token decay **in the linear domain** (``alpha = exp(g)``, fp32): the kernel takes
  ``log2(alpha + 1e-10)`` and accumulates it, so a decay below ``1e-10`` in one token (g < −23)
  is floored there; such a state is gone either way. ``beta`` fp32.
- With ``state_indices`` the initial and output state are the pool itself, read and written by
  slot, in place when both are the same tensor, ``[slots, Hv, V, K]`` as ours. Slots must be
  distinct. Fresh sequences are zeroed in the pool first (the 0.7.2 call has no "read zeros"
  index), one gather and scatter of their states.
- ``use_qk_l2norm_in_kernel`` normalises with eps 1e-6 in fp32 and stores q̂, k̂ in the input
  dtype before the chunk kernel (as fla does).

FlashInfer's own decode ops fuse the gate math from the raw ``a``, ``b`` projections, which this
seam does not pass (it takes ``g`` and ``β``, as the model computes them once for every backend),
so decode steps run kernels/triton/gdn_decode.py as in the `fla` backend. The conv runs infer's
Triton conv kernels, as in the `fla` backend (kernels/gdn/triton_conv.py).

Needs on the machine: flashinfer-python and nvidia-cutlass-dsl (its libs wheels), an sm_90 GPU.
Imported on first use; whatever is missing is refused by name.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch

from kernels.gdn.base import (
    GDNBackendError,
    GDNGeometry,
    StateRows,
    check_state_pool,
    initial_states,
    warm_up_both_phases,
)
from kernels.gdn.triton_conv import TritonConvBackend
from kernels.reference import SpecError
from kernels.triton.gdn_decode import gdn_decode_step

HEAD_SIZE = 128
INPUT_DTYPES = (torch.bfloat16, torch.float16)


def load_flashinfer_prefill(device: torch.device) -> Callable[..., Any]:
    """``flashinfer.gdn_prefill.chunk_gated_delta_rule`` if it can run its SM90 kernel on
    ``device``; GDNBackendError naming what is missing otherwise."""
    if device.type != "cuda":
        raise GDNBackendError(
            "--gdn-backend 'flashinfer' is not available on CPU: FlashInfer's GDN prefill needs an sm_90 GPU"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        raise GDNBackendError(
            f"--gdn-backend 'flashinfer' is not available on {device}: compute capability "
            f"{capability[0]}.{capability[1]}, and infer runs FlashInfer's GDN prefill on sm_90 only"
        )
    try:
        from flashinfer import gdn_prefill
    except ImportError as exc:
        raise GDNBackendError(
            f"--gdn-backend 'flashinfer' needs flashinfer-python, which is not importable ({exc})"
        ) from exc
    if getattr(gdn_prefill, "chunk_gated_delta_rule_sm90", None) is None:
        raise GDNBackendError(
            "--gdn-backend 'flashinfer': FlashInfer's SM90 GDN kernel did not import; it needs "
            "nvidia-cutlass-dsl and its libs wheels (pip install nvidia-cutlass-dsl)"
        )
    prefill = gdn_prefill.chunk_gated_delta_rule
    missing = {"state_indices", "output_state", "max_seqlen"} - set(inspect.signature(prefill).parameters)
    if missing:
        raise GDNBackendError(
            f"--gdn-backend 'flashinfer': this flashinfer's chunk_gated_delta_rule lacks {sorted(missing)} "
            "(0.7.2 or newer has them)"
        )
    return prefill


class FlashInferGDN(TritonConvBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._prefill = load_flashinfer_prefill(device)

    def describe(self) -> str:
        return "flashinfer (prefill: FlashInfer SM90 chunk_gated_delta_rule; decode: infer's slot-indexed Triton step)"

    def check(self, geometry: GDNGeometry, dtype: torch.dtype) -> None:
        check_geometry(geometry, dtype)

    def warm_up(self, geometry: GDNGeometry, dtype: torch.dtype, device: torch.device) -> None:
        """The CuTe-DSL kernel JIT-compiles on first use per specialisation (minutes when cold)."""
        check_geometry(geometry, dtype)
        warm_up_both_phases(self, geometry, dtype, device)

    def delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: StateRows,
        state_pool: torch.Tensor,
    ) -> torch.Tensor:
        tokens, key_heads, key_dim = q.shape
        heads, value_dim = v.shape[1], v.shape[2]
        check_state_pool(state_pool, (heads, value_dim, key_dim), "recurrent state")
        if rows.cu_seqlens is None:
            return gdn_decode_step(q, k, v, g, beta, rows.slots, rows.fresh, state_pool)
        check_geometry(GDNGeometry(key_heads, heads, key_dim, value_dim), v.dtype)
        if q.dtype != v.dtype or k.dtype != v.dtype:
            raise SpecError(
                f"flashinfer GDN prefill: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
            )
        if not state_pool.is_contiguous():
            raise SpecError("flashinfer GDN prefill: the recurrent state pool layer must be contiguous")
        bounds = rows.boundaries(tokens)
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        state_pool.index_copy_(0, rows.slots, initial_states(state_pool, rows))
        if tokens == 0:
            return v.new_empty(v.shape)
        cu = torch.tensor(bounds, dtype=torch.int64).to(q.device, non_blocking=True)
        out, _ = self._prefill(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            g=g.to(torch.float32).exp().contiguous(),
            beta=beta.to(torch.float32).contiguous(),
            initial_state=state_pool,
            output_final_state=True,
            output_state=state_pool,
            cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True,
            state_indices=rows.slots,
            max_seqlen=max(lengths),
        )
        return out


def check_geometry(geometry: GDNGeometry, dtype: torch.dtype) -> None:
    """What FlashInfer's SM90 GDN prefill covers; SpecError naming what it does not."""
    if geometry.key_dim != HEAD_SIZE or geometry.value_dim != HEAD_SIZE:
        raise SpecError(
            f"flashinfer GDN prefill takes head size {HEAD_SIZE} only, got K={geometry.key_dim}, V={geometry.value_dim}"
        )
    if dtype not in INPUT_DTYPES:
        raise SpecError(f"flashinfer GDN prefill takes bf16 or fp16 q/k/v, got {dtype}")
