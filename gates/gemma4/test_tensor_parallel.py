"""Tensor parallelism: TP = 2 (or the run's size) against one rank on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from gates.gemma4.conftest import prompt, prompt_lengths
from gates.harness.tensor_parallel import check_tp_matches_single
from models.gemma4.config import Gemma4Config


def test_tp_matches_single(
    checkpoint_path: Path, gemma4_config: Gemma4Config, serving_dtype: torch.dtype
) -> None:
    """Inside one sliding window, just past it, and across several; the suppressed ids avoided."""
    prompts = [prompt(gemma4_config, n, seed=50 + i) for i, n in enumerate(prompt_lengths(gemma4_config))]
    check_tp_matches_single(checkpoint_path, serving_dtype, prompt(gemma4_config, 60, seed=5), prompts)
