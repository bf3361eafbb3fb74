"""Kernel tests run the Triton kernels at small shapes: on the GPU when there is one, otherwise on
the CPU through Triton's interpreter (so `make test` runs them on a CPU-only CI box).

``triton.jit`` picks the interpreter when a kernel module is imported, so the switch is set here,
before the test modules import anything; should a test elsewhere in the session have imported the
kernel modules first, they are re-imported so their jit functions are interpreted. On a machine
with CUDA nothing is switched, so other suites' Triton kernels keep compiling for the GPU.
GPU runs at serving sizes live in gates/kernels/.
"""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in (
        "kernels.triton.prep_kernel",
        "kernels.triton.attention_prep",
        "kernels.triton",
        "kernels.triton.token_draw",
    ):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])


class _CudaLike:
    """A CPU run's stand-in for a CUDA device, by its type only: what `pick_attention` checks before
    it builds a backend. Nothing given it launches a kernel."""

    type = "cuda"


@pytest.fixture
def cuda_like() -> torch.device:
    return _CudaLike()  # type: ignore[return-value]
