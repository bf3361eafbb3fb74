"""The `fla` GDN backend: fla-core's chunked Triton kernels for prefill, our slot-indexed Triton
kernel (kernels/triton/gdn_decode.py) for decode steps.

Prefill calls ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` on the packed batch (``B = 1``,
``cu_seqlens`` on the device and on the host, so fla builds its chunk index without reading the
device), with ``state_v_first=True`` so its state is the pool's ``[Hv, V, K]``, the L2 norm inside
(``use_qk_l2norm_in_kernel``) and the default scale ``K^-½``. fla reads no slots and writes no pool:
each sequence's state is gathered from its slot (zeros where fresh) and the final state it returns
scattered back. Where it differs from the spec in more than the order of sums: it stores q̂ and k̂
after the L2 norm in the input dtype (bf16 rounding) and keeps its chunk intermediates in it, and
its fp32 ``tl.dot`` runs as TF32 unless ``TRITON_F32_DEFAULT=ieee``. Even then, on sm_80 and
later fla-core 0.6 runs the block merges of its fused triangular solve in TF32
(``SOLVE_TRIL_DOT_PRECISION`` in ``fla/ops/gated_delta_rule/chunk_fwd.py``, no switch), so this
backend declares ``fp32_dots = "tf32"`` there; the agreement gate measures what each costs
(kernels/gdn/agreement.py).

The causal conv runs infer's slot-indexed Triton conv kernels (kernels/gdn/triton_conv.py: they read
and write the conv pool by slot, which fla's ``causal_conv1d`` does not).

fla-core is an optional dependency (``pip install 'infer[gdn]'``), imported on first use.
fla-core routes SM90 bf16 K = V = 128 calls silently to Qwen's `flash-qla` kernels when that
package is installed; ``FLA_FLASH_QLA=0`` is set before the import so this backend is fla's own.
"""

from __future__ import annotations

import itertools
import os
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
from kernels.triton.gdn_decode import gdn_decode_step
from kernels.triton.storage import interpreted

FLA_REQUIREMENT = "fla-core==0.6.0"
INSTALL_HINT = f"pip install 'infer[gdn]' (or: pip install '{FLA_REQUIREMENT}' packaging)"


def load_fla_chunk() -> Callable[..., Any]:
    """fla-core's ``chunk_gated_delta_rule``; GDNBackendError naming the package when it is missing
    or too old to keep the state V-first."""
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        raise GDNBackendError(
            f"--gdn-backend 'fla' needs fla-core, which is not importable ({exc}): {INSTALL_HINT}"
        ) from exc
    import inspect

    if "state_v_first" not in inspect.signature(chunk_gated_delta_rule).parameters:
        raise GDNBackendError(
            "--gdn-backend 'fla': the installed fla-core's chunk_gated_delta_rule has no state_v_first "
            f"(the pool is [slot, Hv, V, K]); install {FLA_REQUIREMENT}: {INSTALL_HINT}"
        )
    return chunk_gated_delta_rule


class FlaGDN(TritonConvBackend):
    name = "fla"

    def __init__(self, device: torch.device, *, interpreter: bool = False) -> None:
        """``interpreter=True`` (tests only) lets it run on CPU under ``TRITON_INTERPRET=1``."""
        if device.type != "cuda" and not (interpreter and interpreted()):
            raise GDNBackendError(
                "--gdn-backend 'fla' is not available on CPU: fla-core's Triton kernels need CUDA"
            )
        super().__init__()
        self._chunk = load_fla_chunk()
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
            self.fp32_dots = "tf32"

    def describe(self) -> str:
        return "fla (prefill: fla-core chunk_gated_delta_rule; decode: infer's slot-indexed Triton step)"

    def warm_up(self, geometry: GDNGeometry, dtype: torch.dtype, device: torch.device) -> None:
        """fla benchmarks its autotuned configs on the first call per head geometry (keys exclude T):
        one varlen prefill here settles them; the decode kernel compiles once per geometry."""
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
        tokens, _, key_dim = q.shape
        heads, value_dim = v.shape[1], v.shape[2]
        check_state_pool(state_pool, (heads, value_dim, key_dim), "recurrent state")
        if rows.cu_seqlens is None:
            return gdn_decode_step(q, k, v, g, beta, rows.slots, rows.fresh, state_pool)
        bounds = rows.boundaries(tokens)
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        initial = initial_states(state_pool, rows)
        if 0 in lengths:
            # fla has no empty sequence; one keeps its initial state (zeros when fresh).
            state_pool.index_copy_(0, rows.slots, initial)
            keep = [n for n, length in enumerate(lengths) if length]
            if not keep:
                return v.new_empty(v.shape)
            picked = torch.tensor(keep, device=rows.slots.device)
            initial = initial.index_select(0, picked)
            slots = rows.slots.index_select(0, picked)
            bounds = (0, *(bounds[n + 1] for n in keep))
        else:
            slots = rows.slots
        cu_cpu = torch.tensor(bounds, dtype=torch.int64)
        out, final = self._chunk(
            q.contiguous()[None],
            k.contiguous()[None],
            v.contiguous()[None],
            g.to(torch.float32).contiguous()[None],
            beta.contiguous()[None],
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
            cu_seqlens=cu_cpu.to(q.device, non_blocking=True),
            cu_seqlens_cpu=cu_cpu,
        )
        state_pool.index_copy_(0, slots, final.to(state_pool.dtype))
        return out[0].to(v.dtype)
