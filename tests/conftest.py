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

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`infer synth qwen3 --preset tiny`, written once per test session."""
    from models.synth.writer import SynthRequest, synthesize

    out = tmp_path_factory.mktemp("tiny-qwen3")
    synthesize(SynthRequest(family="qwen3", preset="tiny", out=out, device="cpu"))
    return out
