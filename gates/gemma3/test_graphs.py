"""CUDA-graph decode replays exactly what the same padded step computes eagerly."""

from __future__ import annotations

from pathlib import Path

import torch

from gates.harness.graph_replay import check_graph_replay_matches_eager
from gates.harness.tolerances import Tolerance
from models.gemma3.config import Gemma3Config


def test_graph_replay_matches_eager(
    checkpoint_path: Path, gemma3_config: Gemma3Config, cuda_device: torch.device, tol: Tolerance
) -> None:
    check_graph_replay_matches_eager(checkpoint_path, gemma3_config.vocab_size, tol)
