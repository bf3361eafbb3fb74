"""The needs a gate can declare, the invariant groups, and the tiers that select gates by need.

Base needs are what the runner itself can check before running anything:
- checkpoint: a checkpoint directory (--checkpoint or INFER_TEST_CHECKPOINT) of a model type the
  suite covers;
- gpu: a CUDA device (torch.cuda.is_available());
- hf-reference: transformers importable and knowing the checkpoint's model type.
A named fixture need is a fixture that a conftest on the suite's path declares in
GATE_FIXTURE_NEEDS together with the base needs it implies (see fixture_needs.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

CHECKPOINT = "checkpoint"
GPU = "gpu"
HF_REFERENCE = "hf-reference"
BASE_NEEDS: tuple[str, ...] = (CHECKPOINT, GPU, HF_REFERENCE)

INVARIANTS: tuple[str, ...] = (
    "numeric-parity",
    "scheduling",
    "kv",
    "lifecycle",
    "loader",
    "device",
    "tokenizer",
)

Tier = Literal["cpu", "gpu", "all"]
TIERS: tuple[Tier, ...] = ("cpu", "gpu", "all")


def in_tier(base_needs: Iterable[str], tier: Tier) -> bool:
    """cpu: gates a machine without a GPU can run; gpu: the gates cpu leaves out (so a CPU run
    and a GPU run split a suite with no overlap); all: every gate."""
    needs_gpu = GPU in set(base_needs)
    if tier == "cpu":
        return not needs_gpu
    if tier == "gpu":
        return needs_gpu
    return True
