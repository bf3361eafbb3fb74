"""Fixtures of the qwen3 suite: the checkpoint served through infer, and transformers beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gates.harness.model_fixtures import hf, hf_fp32, served, serving_dtype, tol  # noqa: F401 (fixtures)
from gates.harness.serving import gate_device
from models.qwen3.config import Qwen3Config, parse_qwen3_config


@pytest.fixture(scope="session")
def qwen3_config(checkpoint_path: Path) -> Qwen3Config:
    return parse_qwen3_config(checkpoint_path)


def prompt_lengths() -> tuple[int, ...]:
    """Prompt sizes: a partial page, a few pages, and (on GPU) a long prompt."""
    return (13, 50, 700) if gate_device().type == "cuda" else (13, 50, 83)
