"""The prep kernel builds for the H200 (sm_90) at every serving shape, checked without a GPU.

The interpreter accepts programs the GPU compiler rejects, so the interpreter tests alone do not
show the kernel builds. ``python -m kernels.triton.aot`` compiles each variant down to a cubin with
the ptxas that ships with Triton; it runs in a child process because this session interprets.
"""

from __future__ import annotations

from sm90_compile import compiled_variants

from kernels.triton.aot import SERVING_VARIANTS


def test_every_variant_compiles_for_sm90() -> None:
    compiled = compiled_variants("kernels.triton.aot")
    assert len(compiled) == len(SERVING_VARIANTS), compiled
