"""Fixtures shared across test areas."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`infer synth qwen3 --preset tiny`, written once per test session."""
    from models.synth.writer import SynthRequest, synthesize

    out = tmp_path_factory.mktemp("tiny-qwen3")
    synthesize(SynthRequest(family="qwen3", preset="tiny", out=out, device="cpu"))
    return out
