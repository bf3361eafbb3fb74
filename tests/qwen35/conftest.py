"""Fixtures of the Qwen3.5 line's tests: one tiny synthetic checkpoint per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`infer synth qwen35 --preset tiny` (qwen3_5_text, fp32, GDN and full-attention layers)."""
    from models.synth.writer import SynthRequest, synthesize

    out = tmp_path_factory.mktemp("tiny-qwen35")
    synthesize(SynthRequest(family="qwen35", preset="tiny", out=out, device="cpu"))
    return out
