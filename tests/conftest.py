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
