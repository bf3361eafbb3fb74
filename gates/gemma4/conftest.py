"""Fixtures of the gemma4 suite: the checkpoint served through infer, and transformers beside it.

Prompt sizes follow the checkpoint's sliding window W, so the same gates cross the window on the
tiny synthetic checkpoint (W of 8-16) and on a real-dimension one (W = 1024).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.contract import Request
from gates.harness.compare import assert_streams_agree
from gates.harness.model_fixtures import hf, hf_fp32, served, serving_dtype, tol  # noqa: F401 (fixtures)
from gates.harness.serving import Completion, greedy, random_prompt
from gates.harness.tolerances import Tolerance
from models.gemma4.config import Gemma4Config, parse_gemma4_config

NEW_TOKENS = 16


@pytest.fixture(scope="session")
def gemma4_config(checkpoint_path: Path) -> Gemma4Config:
    return parse_gemma4_config(checkpoint_path)


def prompt_lengths(config: Gemma4Config) -> tuple[int, ...]:
    """Inside one window, just past it, and across several windows (past a few pages on CPU)."""
    w = config.sliding_window
    return (max(1, w - 3), w + 5, 3 * w + 7)


def prompt(config: Gemma4Config, length: int, seed: int) -> tuple[int, ...]:
    """Random ids that avoid the checkpoint's suppressed ids (infer never emits those)."""
    return random_prompt(length, seed=seed, vocab_size=config.vocab_size, avoid=config.suppress_token_ids)


def request(config: Gemma4Config, rid: str, length: int, seed: int, new_tokens: int = NEW_TOKENS) -> Request:
    return Request(rid, prompt(config, length, seed), greedy(new_tokens))


def agree(
    name: str, a: Completion, b: Completion, tolerance: Tolerance, new_tokens: int = NEW_TOKENS
) -> None:
    assert len(a.tokens) == len(b.tokens) == new_tokens, f"{name}: {len(a.tokens)} and {len(b.tokens)} tokens"
    assert_streams_agree(
        name, a.tokens, a.logprobs, b.tokens, b.logprobs, tolerance.stream_logprob, tolerance.tie
    )
