"""Tensor parallelism: TP = 2 (or the run's size) against one rank on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from gates.gemma3.conftest import prompt, prompt_lengths
from gates.harness.tensor_parallel import check_tp_matches_single
from models.gemma3.config import Gemma3Config


def test_tp_matches_single(
    checkpoint_path: Path, gemma3_config: Gemma3Config, serving_dtype: torch.dtype
) -> None:
    """Corpus text: inside one sliding window, just past it, and across several."""
    prompts = [
        prompt(checkpoint_path, gemma3_config, n, seed=50 + i)
        for i, n in enumerate(prompt_lengths(gemma3_config))
    ]
    scored = prompt(checkpoint_path, gemma3_config, 60, seed=5)
    check_tp_matches_single(checkpoint_path, serving_dtype, scored, prompts)
