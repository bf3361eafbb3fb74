"""Fused Triton kernels: attention prep (QK-norm + rotary + paged K/V write)."""

from kernels.triton.attention_prep import (
    DEFAULT_LAUNCH,
    PrepLaunchConfig,
    PrepLaunchError,
    allocate_prep_outputs,
    attention_prep,
)

__all__ = ["DEFAULT_LAUNCH", "PrepLaunchConfig", "PrepLaunchError", "allocate_prep_outputs", "attention_prep"]
