"""Gated DeltaNet backends behind one seam (kernels/gdn/base.py), chosen by `--gdn-backend`.

- `torch` (torch_backend.py): the spec's math in batched torch ops, on any device.
- `fla` (fla_backend.py): fla-core's chunked Triton prefill, infer's slot-indexed Triton decode
  step (kernels/triton/gdn_decode.py); CUDA, with fla-core installed (`pip install 'infer[gdn]'`).
- `flashinfer` (flashinfer_backend.py): FlashInfer's SM90 prefill, the same decode step; an sm_90
  GPU with flashinfer-python and nvidia-cutlass-dsl.
- `auto` (auto.py): per phase, the fastest of those available here that agree with the spec; torch
  on CPU.

A backend that cannot run here is refused by name, with what is missing.

Beside the backends, decode_mixer.py runs a whole decode step's mixer (conv, gates, delta rule,
gated norm) as three Triton launches under `--decode-fusion`, whatever the backend.
"""

from __future__ import annotations

import logging

import torch

from kernels.gdn.base import GDNBackend, GDNBackendError, GDNGeometry, StateRows
from kernels.gdn.torch_backend import TorchGDN

GDN_BACKENDS = ("auto", "flashinfer", "fla", "torch")

log = logging.getLogger("infer.kernels.gdn")


def build_gdn_backend(name: str, device: torch.device) -> GDNBackend:
    """The named backend (not `auto`) on `device`; GDNBackendError naming what is missing."""
    if name == "torch":
        return TorchGDN()
    if name == "fla":
        from kernels.gdn.fla_backend import FlaGDN

        return FlaGDN(device)
    if name == "flashinfer":
        from kernels.gdn.flashinfer_backend import FlashInferGDN

        return FlashInferGDN(device)
    raise GDNBackendError(f"--gdn-backend {name!r}: unknown (choose from {', '.join(GDN_BACKENDS)})")


def available_gdn_backends(device: torch.device) -> tuple[dict[str, GDNBackend], dict[str, str]]:
    """Every backend that builds on `device` (torch always), and why each other one does not."""
    built: dict[str, GDNBackend] = {"torch": TorchGDN()}
    refused: dict[str, str] = {}
    for name in ("fla", "flashinfer"):
        try:
            built[name] = build_gdn_backend(name, device)
        except GDNBackendError as exc:
            refused[name] = str(exc)
    return built, refused


def pick_gdn_backend(name: str, device: torch.device) -> GDNBackend:
    if name not in GDN_BACKENDS:
        raise GDNBackendError(f"--gdn-backend {name!r}: unknown (choose from {', '.join(GDN_BACKENDS)})")
    if name != "auto":
        backend = build_gdn_backend(name, device)
        log.info("--gdn-backend %s on %s: %s", name, device, backend.describe())
        return backend
    if device.type != "cuda":
        log.info("--gdn-backend auto on %s: torch (the GPU backends need CUDA)", device)
        return TorchGDN()
    built, refused = available_gdn_backends(device)
    for other, why in refused.items():
        log.info("--gdn-backend auto: %s left out: %s", other, why)
    if len(built) == 1:
        log.info("--gdn-backend auto on %s: torch (no other backend is available)", device)
        return built["torch"]
    from kernels.gdn.auto import AutoGDN

    return AutoGDN(device, built)


__all__ = [
    "GDN_BACKENDS",
    "GDNBackend",
    "GDNBackendError",
    "GDNGeometry",
    "StateRows",
    "TorchGDN",
    "available_gdn_backends",
    "build_gdn_backend",
    "pick_gdn_backend",
]
