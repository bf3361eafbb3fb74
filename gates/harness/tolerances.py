"""Tolerances by serving dtype, each next to the measurement it was set from.

fp32 (CPU, tiny synthetic checkpoints): infer and transformers compute the same fp32 math in a
different order; measured |Δ log-prob| ≤ 1e-5 on the tiny presets (2026-12-02), so the bounds
below leave an order of magnitude and still catch any real defect (a wrong norm, rope pairing or
mask moves log-probs by ≥ 1e-2).
bf16 (GPU): a fixed bound would be a guess, so parity is judged against transformers' own bf16
error. Both infer (bf16) and transformers (bf16) are compared with transformers in fp32 on the same
tokens, and infer may be at most `baseline_ratio` times worse (or under the absolute floor). On the
H200, Qwen3-4B synthetic, 1024 tokens (2026-12-02, docs/benchmarks/qwen3.md): infer bf16 vs HF fp32
mean |Δ| 0.0348, p99 0.122, max regret 0.145; HF bf16 vs HF fp32 mean 0.0349, p99 0.113, max
regret 0.138 — infer is as close to fp32 as transformers is, and 1.25× leaves room for noise only.
The scheduling tolerances (stream_logprob, tie) bound two infer runs that differ in batch shape:
bf16 GEMMs of different row counts round differently, ~0.03 typical on these random-weight models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Tolerance:
    # teacher-forced parity against transformers. With baseline_ratio set, each bound is
    # max(floor below, baseline_ratio × transformers' own error at this dtype against fp32).
    baseline_ratio: float | None
    mean_abs: float
    p99_abs: float
    max_regret: float
    min_top5_membership: float
    # two infer runs of one request that only differ in scheduling (chunking, batch neighbours)
    stream_logprob: float
    # a greedy divergence is accepted only where the top-2 margin is below this
    tie: float


FP32 = Tolerance(
    baseline_ratio=None,
    mean_abs=1e-4,
    p99_abs=1e-3,
    max_regret=1e-3,
    min_top5_membership=1.0,
    stream_logprob=1e-4,
    tie=1e-4,
)
BF16 = Tolerance(
    baseline_ratio=1.25,
    mean_abs=0.005,
    p99_abs=0.02,
    max_regret=0.02,
    min_top5_membership=0.99,
    stream_logprob=0.1,
    tie=0.1,
)


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    return FP32 if dtype == torch.float32 else BF16
