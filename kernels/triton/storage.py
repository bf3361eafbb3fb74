"""What every Triton kernel module here shares about its launch: the storage dtypes the kernels
take (and their Triton and signature spellings), whether Triton's interpreter runs them, the
device's SM count, and whether a launch may use programmatic dependent launch (PDL).

PDL, where a kernel takes it (a ``PDL`` constexpr, launched with ``launch_pdl=True``): the kernel
calls ``gdc_launch_dependents()`` first, so the next kernel in the stream may start while it runs,
and ``gdc_wait()`` before it reads anything an earlier kernel wrote or writes anything at all; before
the wait it may read only what no kernel of the step writes (weights, tables filled by host copies
before the step). Every program of a PDL kernel waits, so "the kernel before has completed" holds
transitively along a chain of them. docs/kernels.md, "PDL", tells the story.
"""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

# Storage dtype → the Triton dtype a kernel's STORAGE constexpr names.
STORAGE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# Storage dtype → the pointer type an ahead-of-time signature names.
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (n ≥ 1): `triton.next_power_of_2` for host code, which pays
    ~2 µs a call for Triton's JIT-callable wrapper (launch wrappers call it several times a launch)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def interpreted() -> bool:
    """Whether `TRITON_INTERPRET` is set: kernels then run on the CPU, and tiles go to `tl.dot` in
    fp32 (the interpreter gets bf16 dot wrong)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    ops = hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")
    return ops and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _capability_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Whether a launch on ``device`` can use PDL: CUDA, sm_90 or newer, a Triton with the ops, and
    not turned off with ``INFER_PDL=0`` (for measuring what PDL buys, or ruling it out of a bug)."""
    if interpreted() or device.type != "cuda" or os.environ.get("INFER_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability_has_pdl(index) and _triton_has_pdl()


# What the interpreter counts as the device's SMs (off CUDA there are none to ask).
INTERPRETED_MULTIPROCESSORS = 2


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's SM count (the interpreter's stand-in off CUDA)."""
    if device.type != "cuda":
        return INTERPRETED_MULTIPROCESSORS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
