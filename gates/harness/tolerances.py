"""Tolerances by serving dtype, each next to the measurement it was set from.

fp32 (CPU, tiny synthetic checkpoints): infer and transformers compute the same fp32 math in a
different order; measured |Δ log-prob| ≤ 1e-5 on the tiny presets (2026-12-02), so the bounds
below leave an order of magnitude and still catch any real defect (a wrong norm, rope pairing or
mask moves log-probs by ≥ 1e-2).
bf16 (GPU): set from the H200 runs recorded in docs/benchmarks/ (see the qwen3 page).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Tolerance:
    # teacher-forced parity against transformers
    mean_abs: float
    p99_abs: float
    max_regret: float
    min_top5_membership: float
    # two infer runs of one request that only differ in scheduling (chunking, batch neighbours)
    stream_logprob: float
    # a greedy divergence is accepted only where the top-2 margin is below this
    tie: float


FP32 = Tolerance(
    mean_abs=1e-4, p99_abs=1e-3, max_regret=1e-3, min_top5_membership=1.0, stream_logprob=1e-4, tie=1e-4
)
BF16 = Tolerance(
    mean_abs=0.03, p99_abs=0.15, max_regret=0.15, min_top5_membership=0.99, stream_logprob=0.1, tie=0.1
)


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    return FP32 if dtype == torch.float32 else BF16
