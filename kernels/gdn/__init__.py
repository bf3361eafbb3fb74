"""Gated DeltaNet backends behind one seam (kernels/gdn/base.py), chosen by `--gdn-backend`.

`torch` (kernels/gdn/torch_backend.py) runs everywhere. `fla` (fla-core's Triton kernels) and
`flashinfer` (its `gdn_prefill` and decode ops) are named so that asking for them is refused by
name rather than mistaken for a typo; they are not built yet. `auto` picks the fastest backend
available on the device, which today is `torch` everywhere.
"""

from __future__ import annotations

import logging

import torch

from kernels.gdn.base import GDNBackend, StateRows
from kernels.gdn.torch_backend import TorchGDN

GDN_BACKENDS = ("auto", "flashinfer", "fla", "torch")
_NOT_BUILT = {
    "fla": "fla-core's chunk_gated_delta_rule needs CUDA and is not wired in yet",
    "flashinfer": "FlashInfer's gdn_prefill needs an sm_90 GPU and is not wired in yet",
}

log = logging.getLogger("infer.kernels.gdn")


class GDNBackendError(ValueError):
    """A `--gdn-backend` value that this machine or this build cannot run; the message says why."""


def pick_gdn_backend(name: str, device: torch.device) -> GDNBackend:
    if name not in GDN_BACKENDS:
        raise GDNBackendError(f"--gdn-backend {name!r}: unknown (choose from {', '.join(GDN_BACKENDS)})")
    if name in _NOT_BUILT:
        where = "on CPU" if device.type != "cuda" else f"on {device}"
        raise GDNBackendError(f"--gdn-backend {name!r} is not available {where}: {_NOT_BUILT[name]}")
    if name == "auto":
        log.info("--gdn-backend auto: torch on %s (the only GDN backend built so far)", device)
    return TorchGDN()


__all__ = ["GDN_BACKENDS", "GDNBackend", "GDNBackendError", "StateRows", "TorchGDN", "pick_gdn_backend"]
