"""Lifecycle at the model level: cancellation and the context limit."""

from __future__ import annotations

from pathlib import Path

from gates.harness.lifecycle import check_cancel_frees_and_stops_tokens, check_context_limit_is_refused
from models.qwen3.config import Qwen3Config


def test_cancel_frees_pages_and_stops_tokens(checkpoint_path: Path, qwen3_config: Qwen3Config) -> None:
    check_cancel_frees_and_stops_tokens(checkpoint_path, qwen3_config.vocab_size)


def test_context_limit_is_refused_not_truncated(checkpoint_path: Path, qwen3_config: Qwen3Config) -> None:
    check_context_limit_is_refused(checkpoint_path, qwen3_config.vocab_size)
