"""Fixtures of the Gemma 4 line's tests: one tiny synthetic checkpoint per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`infer synth gemma4 --preset tiny` (model type gemma4_text, both layer kinds, window 8-16)."""
    from models.synth.writer import SynthRequest, synthesize

    out = tmp_path_factory.mktemp("tiny-gemma4")
    synthesize(SynthRequest(family="gemma4", preset="tiny", out=out, device="cpu"))
    return out
