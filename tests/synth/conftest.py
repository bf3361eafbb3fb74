"""Shared, built-once tokenizers for the synth tests (the real Qwen vocabularies take seconds)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from models.synth.families import get_family
from models.synth.tokenizer_build import BuiltTokenizer, build_tokenizer

BuildTokenizer = Callable[[str, str, int], BuiltTokenizer]


@pytest.fixture(scope="session")
def tokenizer_for() -> BuildTokenizer:
    """build(family, kind, vocab_size), memoised for the session."""
    built: dict[tuple[str, str, int], BuiltTokenizer] = {}

    def build(family: str, kind: str, vocab_size: int) -> BuiltTokenizer:
        key = (family, kind, vocab_size)
        if key not in built:
            built[key] = build_tokenizer(get_family(family), kind, vocab_size, 4096)  # type: ignore[arg-type]
        return built[key]

    return build
