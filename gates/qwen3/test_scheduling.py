"""Scheduling must not change what a request computes: chunking, neighbours, order, prefix hits."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Request
from gates.harness.scheduling import (
    NEW_TOKENS,
    assert_completions_agree,
    check_chunked_prefill_matches_whole,
    check_mixed_step_matches_serial,
    check_row_order_does_not_matter,
)
from gates.harness.serving import drive, greedy, load_for_gate, random_prompt
from gates.harness.tolerances import Tolerance
from gates.qwen3.conftest import prompt_lengths
from models.qwen3.config import Qwen3Config


def test_chunked_prefill_matches_whole(
    checkpoint_path: Path, qwen3_config: Qwen3Config, tol: Tolerance
) -> None:
    check_chunked_prefill_matches_whole(
        checkpoint_path, qwen3_config.vocab_size, tol, max(prompt_lengths()), (1, 15, 16, 17)
    )


def test_mixed_step_matches_serial(checkpoint_path: Path, qwen3_config: Qwen3Config, tol: Tolerance) -> None:
    """A request prefilled beside live decodes computes what it computes alone."""
    check_mixed_step_matches_serial(checkpoint_path, qwen3_config.vocab_size, tol, prompt_lengths())


def test_prefix_restore_matches_cold(
    checkpoint_path: Path, qwen3_config: Qwen3Config, tol: Tolerance
) -> None:
    shared = random_prompt(48, seed=51, vocab_size=qwen3_config.vocab_size)
    first = Request(
        "first", shared + random_prompt(7, seed=52, vocab_size=qwen3_config.vocab_size), greedy(4)
    )
    second = Request(
        "second", shared + random_prompt(9, seed=53, vocab_size=qwen3_config.vocab_size), greedy(NEW_TOKENS)
    )
    cold = drive(load_for_gate(checkpoint_path), [second])["second"]
    served = load_for_gate(checkpoint_path)
    drive(served, [first])
    warm = drive(served, [second])["second"]
    assert cold.cached_tokens == 0, f"a cold start reported {cold.cached_tokens} cached tokens"
    assert warm.cached_tokens is not None and warm.cached_tokens >= 32, (
        f"no prefix hit: cached_tokens={warm.cached_tokens}"
    )
    assert_completions_agree("prefix hit vs cold", warm, cold, tol)


def test_batch_row_order_does_not_matter(
    checkpoint_path: Path, qwen3_config: Qwen3Config, tol: Tolerance
) -> None:
    check_row_order_does_not_matter(checkpoint_path, qwen3_config.vocab_size, tol, prompt_lengths())
