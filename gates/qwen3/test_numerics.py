"""Numeric policies on the Qwen3 line: batch invariance bit for bit, and the graph-memory reservation."""

from __future__ import annotations

from pathlib import Path

import torch

from gates.harness.graph_memory import check_graph_memory_is_reserved
from gates.harness.invariance import check_batch_invariance_on_every_bucket
from models.qwen3.config import Qwen3Config


def test_batch_invariance_is_bitwise(
    checkpoint_path: Path, qwen3_config: Qwen3Config, cuda_device: torch.device
) -> None:
    check_batch_invariance_on_every_bucket(checkpoint_path, qwen3_config.vocab_size)


def test_graph_memory_is_reserved(
    checkpoint_path: Path, qwen3_config: Qwen3Config, cuda_device: torch.device
) -> None:
    check_graph_memory_is_reserved(checkpoint_path, qwen3_config.vocab_size)
