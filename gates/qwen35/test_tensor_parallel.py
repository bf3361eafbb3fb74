"""Tensor parallelism: TP = 2 (or the run's size) against one rank on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from gates.harness.serving import random_prompt
from gates.harness.tensor_parallel import check_tp_matches_single
from models.qwen35.config import Qwen35Config


def test_tp_matches_single(
    checkpoint_path: Path, qwen35_config: Qwen35Config, serving_dtype: torch.dtype
) -> None:
    vocab = qwen35_config.vocab_size
    prompts = [random_prompt(n, seed=50 + i, vocab_size=vocab) for i, n in enumerate((5, 17, 40))]
    check_tp_matches_single(
        checkpoint_path, serving_dtype, random_prompt(60, seed=5, vocab_size=vocab), prompts
    )
