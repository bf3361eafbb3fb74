"""Fixtures of the gemma3 suite: the checkpoint served through infer, and transformers beside it.

The same gates run on the tiny synthetic checkpoint (window 12) and on the real Gemma 3 270M
weights (window 512), so prompt sizes follow the checkpoint's sliding window W. Prompts are text
(the built-in corpus, through the checkpoint's own tokenizer, after its BOS): on real weights a
text prompt gives the sharp distributions where an off-by-one in a mask or a norm shows at once,
which random ids do not.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.contract import Request
from gates.harness.compare import assert_streams_agree
from gates.harness.model_fixtures import hf, hf_fp32, served, serving_dtype, tol  # noqa: F401 (fixtures)
from gates.harness.serving import Completion, greedy
from gates.harness.tolerances import Tolerance
from kernels.kv_layout import PAGE_SIZE
from models.gemma3.config import Gemma3Config, parse_gemma3_config
from models.synth.corpus import CORPUS

NEW_TOKENS = 16


@pytest.fixture(scope="session")
def gemma3_config(checkpoint_path: Path) -> Gemma3Config:
    return parse_gemma3_config(checkpoint_path)


def prompt_lengths(config: Gemma3Config) -> tuple[int, ...]:
    """Inside one window, just past it, and past it by several windows or by eight pages,
    whichever is shorter (a real window of 512 makes three windows a slow prompt on a CPU)."""
    w = config.sliding_window
    return (max(1, w - 3), w + 5, min(3 * w + 7, w + 8 * PAGE_SIZE))


@cache
def _corpus_ids(checkpoint: Path) -> tuple[int, ...]:
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return tuple(tokenizer.encode("\n".join(CORPUS), add_special_tokens=False).ids)


def prompt(checkpoint: Path, config: Gemma3Config, length: int, seed: int) -> tuple[int, ...]:
    """BOS, then `length - 1` corpus tokens from a seed-chosen start (wrapping round the corpus)."""
    ids = _corpus_ids(checkpoint)
    start = (seed * 7919) % len(ids)
    body = [ids[(start + i) % len(ids)] for i in range(length - 1)]
    bos = [] if config.bos_token_id is None else [config.bos_token_id]
    return tuple(bos + body)[:length]


def request(
    checkpoint: Path, config: Gemma3Config, rid: str, length: int, seed: int, new_tokens: int = NEW_TOKENS
) -> Request:
    return Request(rid, prompt(checkpoint, config, length, seed), greedy(new_tokens))


def agree(
    name: str, a: Completion, b: Completion, tolerance: Tolerance, new_tokens: int = NEW_TOKENS
) -> None:
    assert len(a.tokens) == len(b.tokens) == new_tokens, f"{name}: {len(a.tokens)} and {len(b.tokens)} tokens"
    assert_streams_agree(
        name, a.tokens, a.logprobs, b.tokens, b.logprobs, tolerance.stream_logprob, tolerance.tie
    )
