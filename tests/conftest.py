"""Fixtures shared across test areas.

Without CUDA, Triton kernels run under the interpreter. `triton.jit` decides that when a kernel
module is imported, and any test module may import one (through engine or kernels code) during
collection, so the switch is made here, before pytest imports a single test module.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


def _dot_from_each_row_alone() -> None:
    """The interpreter's ``tl.dot``, made to compute each output from its own row and column only.

    Triton's interpreter hands a dot to the host's BLAS, whose bits can depend on where a row sits
    in the tile: OpenBLAS's Haswell/Zen sgemm kernel (an AMD EPYC with AVX2, 2026-12-06) gives rows
    0-5 and 6-11 of each 12 different bits for the same data. On the GPU an MMA's output depends
    on its row and column alone, and the kernels' batch-invariance tests (a row alone against the
    row inside a batch) test exactly that. So the dot here is the products in the accumulator's
    dtype (exact for bf16/fp16 operands) summed over K by numpy's reduction, whose order depends on
    K only. Dots of 8-bit floats (no kernel here takes them) keep Triton's own path.
    """
    import numpy as np
    from triton.runtime import interpreter

    triton_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            return triton_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data
        products = a.data.astype(acc.dtype)[..., :, :, None] * b.data.astype(acc.dtype)[..., None, :, :]
        return interpreter.TensorHandle(np.add.reduce(products, axis=-2) + acc, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _dot_from_each_row_alone()


def _tiny_checkpoint(factory: pytest.TempPathFactory, family: str) -> Path:
    """`infer synth FAMILY --preset tiny` (fp32, CPU), written once per test session and worker."""
    from models.synth.writer import SynthRequest, synthesize

    out = factory.mktemp(f"tiny-{family}")
    synthesize(SynthRequest(family=family, preset="tiny", out=out, device="cpu"))
    return out


# Tests read these checkpoints and never write into them: a test that needs a variant copies one.
@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_checkpoint(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Model type gemma4_text, both layer kinds, window 8-16."""
    return _tiny_checkpoint(tmp_path_factory, "gemma4")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gemma3_text, both layer kinds, the last layer sliding, window 12."""
    return _tiny_checkpoint(tmp_path_factory, "gemma3")


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen3_5_text, GDN and full-attention layers."""
    return _tiny_checkpoint(tmp_path_factory, "qwen35")
