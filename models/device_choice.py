"""Device, dtype and attention backend defaults shared by the real model lines."""

from __future__ import annotations

import importlib.util

import torch

from kernels.attention.base import AttentionBackend
from kernels.attention.torch_backend import TorchAttention
from kernels.gemm.names import is_end_to_end_invariant
from models.registry import ModelLoadError, ModelOptions

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def pick_device(options: ModelOptions) -> torch.device:
    if options.device:
        device = torch.device(options.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError(f"--device {options.device!r}: no CUDA device is available")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(options: ModelOptions, device: torch.device) -> torch.dtype:
    """bf16 on GPU; fp32 on CPU (exact parity with references), either by `--dtype`; float64 on the
    CPU only, as the reference a serving dtype's error is measured against (gates.harness)."""
    if options.dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if options.dtype not in _DTYPES:
        raise ModelLoadError(f"--dtype {options.dtype!r}: expected one of auto, {', '.join(_DTYPES)}")
    if options.dtype == "float64" and device.type != "cpu":
        raise ModelLoadError(f"--dtype float64 on {device}: float64 is the CPU reference dtype only")
    return _DTYPES[options.dtype]


# FlashInfer builds its attention kernels for these storage dtypes only (its JIT has no fp32 variant).
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)


def pick_attention(
    options: ModelOptions, device: torch.device, dtype: torch.dtype, max_pages_per_seq: int
) -> AttentionBackend:
    """`--attention-backend`, or by default: on CUDA in bf16/fp16, `triton` (decode steps of up to
    `KERNEL_ROWS` rows through the split-KV Triton kernel, every other step through FlashInfer)
    under a policy that is not end-to-end invariant, and `flashinfer` (its batch-invariant split)
    under one, or where flashinfer is not installed (which then says so); torch otherwise."""
    name = options.attention_backend or _default_attention(options, device, dtype)
    if name == "torch":
        return TorchAttention()
    if name == "flashinfer":
        if device.type != "cuda":
            raise ModelLoadError("--attention-backend flashinfer needs a CUDA device")
        return _flashinfer(options, device, dtype, max_pages_per_seq)
    if name == "triton":
        return _triton(options, device, dtype, max_pages_per_seq)
    raise ModelLoadError(f"--attention-backend {name!r}: unknown (available: torch, flashinfer, triton)")


def _default_attention(options: ModelOptions, device: torch.device, dtype: torch.dtype) -> str:
    if device.type != "cuda" or dtype not in FLASHINFER_DTYPES:
        return "torch"
    # Under an end-to-end invariant policy the kernel would serve every decode step (a row's kernel
    # must not follow the batch), and at batch 64 it measured much slower than FlashInfer.
    if is_end_to_end_invariant(options.engine.numeric_policy):
        return "flashinfer"
    return "triton" if importlib.util.find_spec("flashinfer") is not None else "flashinfer"


def _flashinfer(
    options: ModelOptions, device: torch.device, dtype: torch.dtype, max_pages_per_seq: int
) -> AttentionBackend:
    if dtype not in FLASHINFER_DTYPES:
        raise ModelLoadError(
            f"--attention-backend flashinfer with dtype {dtype}: FlashInfer's kernels take bfloat16 and "
            "float16 only (torch or triton attention run float32)"
        )
    try:  # FlashInferAttention imports flashinfer in its constructor
        from kernels.attention.flashinfer_backend import FlashInferAttention

        # The end-to-end invariant policies need a KV split that does not follow the batch.
        return FlashInferAttention(
            device,
            dtype,
            max_pages_per_seq,
            batch_invariant=is_end_to_end_invariant(options.engine.numeric_policy),
        )
    except ImportError as exc:
        raise ModelLoadError(f"--attention-backend flashinfer: flashinfer is not installed ({exc})") from exc


def _triton(
    options: ModelOptions, device: torch.device, dtype: torch.dtype, max_pages_per_seq: int
) -> AttentionBackend:
    """The split-KV Triton decode kernel, prefill steps by FlashInfer on CUDA in bf16/fp16 (the torch
    backend in fp32, where FlashInfer is not installed, or on a CPU under the Triton interpreter)."""
    from kernels.attention.triton_decode_backend import TritonDecodeAttention
    from kernels.triton.storage import interpreted

    if device.type != "cuda" and not interpreted():
        raise ModelLoadError(
            f"--attention-backend triton on {device}: the Triton kernel needs a CUDA device "
            "(or TRITON_INTERPRET=1, the interpreter, for tests)"
        )
    with_flashinfer = (
        device.type == "cuda"
        and dtype in FLASHINFER_DTYPES
        and importlib.util.find_spec("flashinfer") is not None
    )
    inner = _flashinfer(options, device, dtype, max_pages_per_seq) if with_flashinfer else TorchAttention()
    return TritonDecodeAttention(
        inner,
        device,
        dtype,
        max_pages_per_seq,
        max_rows=options.engine.max_num_seqs,
        kernel_rows=triton_kernel_rows(options.engine.numeric_policy, inner),
    )


def triton_kernel_rows(policy: str, inner: AttentionBackend) -> int | None:
    """The most decode rows the Triton kernel serves beside ``inner``: every step (None) under an
    end-to-end invariant policy (a row's kernel must not follow the batch) or beside a backend other
    than FlashInfer (what it was measured against); else ``KERNEL_ROWS``, the batches where it
    measured faster than FlashInfer."""
    from kernels.attention.triton_decode_backend import KERNEL_ROWS

    if is_end_to_end_invariant(policy) or inner.name != "flashinfer":
        return None
    return KERNEL_ROWS
