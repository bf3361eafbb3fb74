"""The GDN causal conv as the GPU backends (`fla`, `flashinfer`) run it: one Triton launch a step.

A prefill step (``StateRows.cu_seqlens`` given) runs kernels/triton/gdn_conv_varlen.py over the packed
batch, a decode step (one token per row) kernels/triton/gdn_conv_step.py; both read each row's history
from its slot (zeros where fresh, the slot unread), write the row's last W − 1 inputs back, and give
the spec's fp32 sum bit for bit, as ``TorchGDN.conv`` computes it (``reference.causal_conv1d``), up to
the last bit of ``exp`` in the SiLU. Off CUDA (unless Triton's interpreter runs), and for a conv the
kernels refuse (a width other than 2-4, a storage dtype other than bf16/fp16/fp32, a pool in another
dtype than x, strided weights or pool channels), the torch form runs, each reason logged once.
docs/kernels.md, "Gated DeltaNet", tells the story.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kernels.gdn.base import GDNBackend, StateRows, check_state_pool
from kernels.gdn.torch_backend import TorchGDN
from kernels.reference import SpecError
from kernels.triton.gdn_conv_step import check_conv_kernels, gdn_conv_step
from kernels.triton.gdn_conv_varlen import (
    VarlenRows,
    gdn_conv_varlen,
    gdn_conv_varlen_pieces,
    pieces_fit,
    varlen_rows,
)
from kernels.triton.storage import interpreted

log = logging.getLogger("infer.kernels.gdn")


def conv_kernel_refusal(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor) -> str | None:
    """Why the Triton conv kernels do not take this layer's conv, or None when they do."""
    channels, width = weight.shape
    if x.device.type != "cuda" and not interpreted():
        return f"device {x.device}: the Triton conv kernels need CUDA"
    try:
        check_conv_kernels(channels, width, x.dtype)
    except SpecError as exc:
        return str(exc)
    if conv_pool.dtype != x.dtype:
        return f"conv pool {conv_pool.dtype}, x {x.dtype}: the Triton conv kernels take one dtype"
    if weight.stride() != (width, 1) or conv_pool.stride(-1) != 1:
        return f"conv weight strides {weight.stride()}, pool strides {conv_pool.stride()}: not contiguous"
    return None


class TritonConv:
    """``GDNBackend.conv`` through the Triton conv kernels where they apply, the torch form elsewhere."""

    def __init__(self) -> None:
        self._torch = TorchGDN()
        self._logged: set[str] = set()
        # The last step's rows and their boundaries on the device: every GDN layer of a step passes
        # the same StateRows, so the boundaries are copied up once a step, not once a layer. Held
        # by reference, so `is` cannot match a new object at a recycled address.
        self._bounds_of: tuple[StateRows, VarlenRows] | None = None

    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, rows: StateRows, conv_pool: torch.Tensor
    ) -> torch.Tensor:
        (y,) = self.conv_pieces(x, weight, rows, conv_pool, (weight.shape[0],))
        return y

    def conv_pieces(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        rows: StateRows,
        conv_pool: torch.Tensor,
        widths: Sequence[int],
    ) -> tuple[torch.Tensor, ...]:
        """``GDNBackend.conv_pieces``: a prefill step's pieces each dense from the varlen kernel
        where their boundaries fit its channel blocks; otherwise views of one output."""
        channels, width = weight.shape
        check_state_pool(conv_pool, (width - 1, channels), "conv state")
        refusal = conv_kernel_refusal(x, weight, conv_pool)
        if refusal is not None:
            if refusal not in self._logged:
                self._logged.add(refusal)
                log.info("GDN conv: the torch form runs: %s", refusal)
            return self._torch.conv_pieces(x, weight, rows, conv_pool, widths)
        if rows.cu_seqlens is None:
            return tuple(
                gdn_conv_step(x, weight, rows.slots, rows.fresh, conv_pool).split(list(widths), dim=-1)
            )
        if self._bounds_of is None or self._bounds_of[0] is not rows:
            self._bounds_of = (rows, varlen_rows(rows.boundaries(x.shape[0]), x.device))
        bounds = self._bounds_of[1]
        if pieces_fit(widths):
            return gdn_conv_varlen_pieces(x, weight, bounds, rows.slots, rows.fresh, conv_pool, widths)
        why = f"pieces {list(widths)} off the kernel's channel blocks: views of one output (not dense)"
        if why not in self._logged:
            self._logged.add(why)
            log.info("GDN conv: %s", why)
        y = gdn_conv_varlen(x, weight, bounds, rows.slots, rows.fresh, conv_pool)
        return tuple(y.split(list(widths), dim=-1))


class TritonConvBackend(GDNBackend):
    """A GDN backend whose conv is ``TritonConv``'s (`fla`, `flashinfer`): both conv ops go there;
    a subclass brings its delta rule and calls ``super().__init__()``."""

    def __init__(self) -> None:
        self._conv = TritonConv()

    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, rows: StateRows, conv_pool: torch.Tensor
    ) -> torch.Tensor:
        return self._conv.conv(x, weight, rows, conv_pool)

    def conv_pieces(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        rows: StateRows,
        conv_pool: torch.Tensor,
        widths: Sequence[int],
    ) -> tuple[torch.Tensor, ...]:
        return self._conv.conv_pieces(x, weight, rows, conv_pool, widths)
