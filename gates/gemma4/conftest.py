"""Fixtures of the gemma4 suite: the checkpoint served through infer, and transformers beside it.

Prompt sizes follow the checkpoint's sliding window W, so the same gates cross the window on the
tiny synthetic checkpoint (W of 8-16) and on a real-dimension one (W = 1024).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.contract import Request
from gates.harness.compare import assert_streams_agree
from gates.harness.hf_reference import hf_model
from gates.harness.serving import Completion, gate_device, greedy, load_for_gate, random_prompt
from gates.harness.tolerances import Tolerance, tolerance_for
from models.gemma4.config import Gemma4Config, parse_gemma4_config
from models.registry import LoadedModel

NEW_TOKENS = 16


@pytest.fixture(scope="session")
def gemma4_config(checkpoint_path: Path) -> Gemma4Config:
    return parse_gemma4_config(checkpoint_path)


@pytest.fixture(scope="session")
def serving_dtype() -> torch.dtype:
    return torch.bfloat16 if gate_device().type == "cuda" else torch.float32


@pytest.fixture(scope="session")
def tol(serving_dtype: torch.dtype) -> Tolerance:
    return tolerance_for(serving_dtype)


@pytest.fixture()
def served(checkpoint_path: Path) -> Iterator[LoadedModel]:
    """A fresh load per gate: no pages carried over from another gate."""
    model = load_for_gate(checkpoint_path)
    yield model
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def hf(checkpoint_path: Path, serving_dtype: torch.dtype) -> Any:
    """transformers at infer's serving dtype."""
    return hf_model(checkpoint_path, gate_device(), serving_dtype)


@pytest.fixture(scope="session")
def hf_fp32(checkpoint_path: Path, serving_dtype: torch.dtype, hf: Any) -> Any:
    """transformers in fp32: the reference both infer and `hf` are measured against."""
    if serving_dtype == torch.float32:
        return hf
    return hf_model(checkpoint_path, gate_device(), torch.float32)


def prompt_lengths(config: Gemma4Config) -> tuple[int, ...]:
    """Inside one window, just past it, and across several windows (past a few pages on CPU)."""
    w = config.sliding_window
    return (max(1, w - 3), w + 5, 3 * w + 7)


def prompt(config: Gemma4Config, length: int, seed: int) -> tuple[int, ...]:
    """Random ids that avoid the checkpoint's suppressed ids (infer never emits those)."""
    return random_prompt(length, seed=seed, vocab_size=config.vocab_size, avoid=config.suppress_token_ids)


def request(config: Gemma4Config, rid: str, length: int, seed: int, new_tokens: int = NEW_TOKENS) -> Request:
    return Request(rid, prompt(config, length, seed), greedy(new_tokens))


def agree(name: str, a: Completion, b: Completion, tol: Tolerance, new_tokens: int = NEW_TOKENS) -> None:
    assert len(a.tokens) == len(b.tokens) == new_tokens, f"{name}: {len(a.tokens)} and {len(b.tokens)} tokens"
    assert_streams_agree(name, a.tokens, a.logprobs, b.tokens, b.logprobs, tol.stream_logprob, tol.tie)
