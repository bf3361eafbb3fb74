"""Numeric parity with transformers on the same checkpoint (teacher-forced and greedy)."""

from __future__ import annotations

from typing import Any

from gates.harness.hf_parity import check_full_forward_matches_hf, check_greedy_matches_hf_generate
from gates.harness.tolerances import Tolerance
from gates.qwen35.conftest import prompt_lengths
from models.qwen35.config import Qwen35Config
from models.registry import LoadedModel


def test_full_forward_matches_hf(
    served: LoadedModel, hf: Any, hf_fp32: Any, qwen35_config: Qwen35Config, tol: Tolerance
) -> None:
    check_full_forward_matches_hf(served, hf, hf_fp32, qwen35_config.vocab_size, max(prompt_lengths()), tol)


def test_greedy_matches_hf_generate(
    served: LoadedModel, hf: Any, qwen35_config: Qwen35Config, tol: Tolerance
) -> None:
    check_greedy_matches_hf_generate(served, hf, qwen35_config.vocab_size, prompt_lengths(), tol)
