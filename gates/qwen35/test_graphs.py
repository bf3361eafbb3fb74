"""CUDA-graph decode with state slots replays exactly what the same padded step computes eagerly:
the slot index sits in the graph's static buffers, filler rows read and write the padding slot."""

from __future__ import annotations

from pathlib import Path

import torch

from gates.harness.graph_replay import check_graph_replay_matches_eager
from gates.harness.tolerances import Tolerance
from models.qwen35.config import Qwen35Config


def test_graph_replay_matches_eager(
    checkpoint_path: Path, qwen35_config: Qwen35Config, cuda_device: torch.device, tol: Tolerance
) -> None:
    check_graph_replay_matches_eager(checkpoint_path, qwen35_config.vocab_size, tol)
