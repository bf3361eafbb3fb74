"""Numeric policies on the Gemma 4 line (both KV groups): batch invariance bit for bit, and the
graph-memory reservation. Prompts avoid the checkpoint's suppressed ids."""

from __future__ import annotations

from pathlib import Path

import torch

from gates.harness.graph_memory import check_graph_memory_is_reserved
from gates.harness.invariance import check_batch_invariance_on_every_bucket
from models.gemma4.config import Gemma4Config


def test_batch_invariance_is_bitwise(
    checkpoint_path: Path, gemma4_config: Gemma4Config, cuda_device: torch.device
) -> None:
    avoid = sorted(gemma4_config.suppress_token_ids)
    check_batch_invariance_on_every_bucket(checkpoint_path, gemma4_config.vocab_size, avoid)


def test_graph_memory_is_reserved(
    checkpoint_path: Path, gemma4_config: Gemma4Config, cuda_device: torch.device
) -> None:
    avoid = sorted(gemma4_config.suppress_token_ids)
    check_graph_memory_is_reserved(checkpoint_path, gemma4_config.vocab_size, avoid)
