"""Fixtures of the Gemma 3 line's tests: one tiny synthetic checkpoint per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`infer synth gemma3 --preset tiny` (gemma3_text, both layer kinds, the last layer sliding, window 12)."""
    from models.synth.writer import SynthRequest, synthesize

    out = tmp_path_factory.mktemp("tiny-gemma3")
    synthesize(SynthRequest(family="gemma3", preset="tiny", out=out, device="cpu"))
    return out
