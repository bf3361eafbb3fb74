"""Fixtures of the qwen35 suite: the checkpoint served through infer, and transformers beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gates.harness.model_fixtures import hf, hf_fp32, served, serving_dtype, tol  # noqa: F401 (fixtures)
from gates.harness.serving import gate_device
from models.qwen35.config import Qwen35Config, parse_qwen35_config


@pytest.fixture(scope="session")
def qwen35_config(checkpoint_path: Path) -> Qwen35Config:
    return parse_qwen35_config(checkpoint_path)


def prompt_lengths() -> tuple[int, ...]:
    """Prompt sizes: a partial page, a few pages, and one past two 64-token GDN chunks (on GPU, a
    long prompt)."""
    return (13, 50, 700) if gate_device().type == "cuda" else (13, 50, 133)
