"""The needs a gate can declare, the invariant groups, and the tiers that select gates by need.

Base needs are what the runner itself can check before running anything:
- checkpoint: a checkpoint directory (--checkpoint or INFER_TEST_CHECKPOINT) of a model type the
  suite covers;
- gpu: a CUDA device (torch.cuda.is_available());
- hf-reference: transformers importable and knowing the checkpoint's model type;
- gpus:N: N ranks of the gate's device. Without CUDA the ranks are N gloo processes on the CPU and
  the need is met; with CUDA each rank needs a GPU of its own, so at least N must be visible
  (torch.cuda.device_count()). It does not put a gate in the gpu tier: such a gate runs on
  whichever device the machine has.
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
GPUS_PREFIX = "gpus:"
# The tensor-parallel size `infer gates --tensor-parallel-size N` runs every gate's engines at
# (gates.harness.serving reads it; unset means 1).
TENSOR_PARALLEL_ENV = "INFER_GATE_TENSOR_PARALLEL_SIZE"
# The decode-path knobs `infer gates --decode-fusion` (and its siblings, DECODE_PATH_KNOBS) run every
# gate's engines with, as a JSON object of knob name to value (unset or empty: the defaults).
DECODE_PATH_ENV = "INFER_GATE_DECODE_PATH"
# The engine and model knobs that pick how a step runs without changing what it computes: a run of
# the manifest with them is how a path earns its way to a default.
DECODE_PATH_KNOBS: tuple[str, ...] = (
    "decode_fusion",
    "attention_backend",
    "sampling_backend",
    "async_scheduling",
    "prefill_graphs",
)


def gpus_need(ranks: int) -> str:
    return f"{GPUS_PREFIX}{ranks}"


def gpus_of(need: str) -> int | None:
    """N of a well-formed `gpus:N` need (N a whole number ≥ 1), else None."""
    if not need.startswith(GPUS_PREFIX):
        return None
    digits = need.removeprefix(GPUS_PREFIX)
    if not digits.isdigit() or digits.startswith("0"):
        return None
    return int(digits)


def is_base_need(need: str) -> bool:
    return need in BASE_NEEDS or gpus_of(need) is not None


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
