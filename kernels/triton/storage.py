"""What every Triton kernel module here shares about its launch: the storage dtypes the kernels
take (and their Triton and signature spellings), and whether Triton's interpreter runs them."""

from __future__ import annotations

import os

import torch
import triton.language as tl

# Storage dtype → the Triton dtype a kernel's STORAGE constexpr names.
STORAGE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# Storage dtype → the pointer type an ahead-of-time signature names.
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def interpreted() -> bool:
    """Whether `TRITON_INTERPRET` is set: kernels then run on the CPU, and tiles go to `tl.dot` in
    fp32 (the interpreter gets bf16 dot wrong)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
