"""Tolerances by serving dtype, each next to the measurement it was set from.

fp32 (CPU: tiny synthetic checkpoints, real Gemma 3 270M): infer and transformers compute the
same fp32 math in a different order; measured |Δ log-prob| ≤ 1e-5 on the tiny presets
(2026-12-02), and on Gemma 3 270M's real weights over 639 text positions (2026-12-03,
gates/gemma3) mean 2.3e-6, p99 1.2e-5, max 3.8e-5. So the bounds below leave an order of
magnitude and still catch any real defect (a wrong norm, rope pairing or mask moves log-probs by
≥ 1e-2).
bf16 (GPU): a fixed bound would be a guess, so parity is judged against transformers' own bf16
error. Both infer (bf16) and transformers (bf16) are compared with transformers in fp32 on the same
tokens, and infer may be at most `baseline_ratio` times worse (or under the absolute floor). On the
H200, Qwen3-4B synthetic, 1024 tokens (2026-12-02, docs/benchmarks/qwen3.md): infer bf16 vs HF fp32
mean |Δ| 0.0348, p99 0.122, max regret 0.145; HF bf16 vs HF fp32 mean 0.0349, p99 0.113, max
regret 0.138 — infer is as close to fp32 as transformers is, and 1.25× leaves room for noise only.

Max regret is not given a ratio of its own: it is the worst of the ~6 % of positions where the two
argmaxes part, a maximum over a few hundred near-ties that moves by tens of percent between two
equally good bf16 implementations. It follows from the p99 bound instead, by the argument `tie`
uses: where infer picks x and the reference y, infer's log-probs put x at or above y, so the
reference loses at most |Δ_x| + |Δ_y|, which is ≤ 2 × p99 bound while both sit within the noise the
p99 bound accepts. On the H200, Gemma 4 12B synthetic, 3078 positions (2026-12-03, 61f079e,
docs/benchmarks/gemma4.md): infer mean 0.0317, p99 0.105, max regret 0.197; transformers bf16 mean
0.0320, p99 0.108, max regret 0.152 — infer no worse in mean or p99, yet 1.30× in max regret, which
a 1.25× ratio on the maximum refused. The bound there is 2 × 1.25 × 0.108 = 0.27; a wrong mask or
rope at even a few positions costs a nat or more.

The scheduling tolerances (stream_logprob, tie) bound two infer runs that differ in batch shape:
bf16 GEMMs of different row counts round differently, ~0.03 typical on these random-weight models.
Gemma 4 12B synthetic on the H200: every scheduling gate's |Δ log-prob| is a multiple of 1/32 — its
logits are soft-capped in bf16 and sit in [4, 8), where a bf16 step is 2^-5. At 261eee0 and
3a1aa3d (2026-12-02) the largest was 3 steps (0.094), and 3 steps is where most gates' maxima sit
(docs/benchmarks/gemma4.md): it is the noise's usual maximum, not its tail. At a2a17b6 (2026-12-03)
the overlapped-prefill gate moved 5 steps (0.156) once, at token 13 of a 5-token prompt's stream
after 13 equal tokens, every other of its 6 streams ≤ 3 steps; a decode row's context is its own
earlier tokens, so two runs' rounding compounds along a stream, most where the context is short.
So the bound is LOGIT_STEPS = 6 steps at the checkpoint's largest logit (`for_logits`, applied by
the suites' `tol` fixture), and never under the 0.1 floor (logits under 4, finer steps).

`tie` is not a second guess: if two runs' log-probs differ by at most δ = stream_logprob per
token, two streams that part (A picks x, B picks y) have margins m_A + m_B ≤ 2δ, so a divergence
where both margins are ≤ 2δ is what that noise can do and nothing more. At tie = δ the H200 run
refused such a part: Gemma's overlapped-prefill streams parted where one margin was 0.125 (4
steps of 2^-5), which two 2-step moves produce.

What the wider bound gives up, and keeps: at 6 steps of 2^-5 the tie bound is 0.375. The one
defect these bounds have caught so far, transformers' reference with RoPE's inv_freq rounded to
bf16 (docs/benchmarks/qwen3.md), cost 0.391 at the part, so it is still refused, by a small
margin. Scheduling defects (a wrong mask, position or page) are caught first by the same gates
on the CPU in fp32, where the stream bound is 1e-4 (FP32 below). A real checkpoint's top logits
sit in higher binades (Gemma's cap is 30, where a bf16 step is 0.125) and move by those larger
steps, hence a bound in steps rather than in nats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

# Steps of bf16 at the top logit that two runs' log-probs may differ by (module doc).
LOGIT_STEPS = 6


@dataclass(frozen=True, slots=True)
class Tolerance:
    # teacher-forced parity against transformers. With baseline_ratio set, each bound is
    # max(floor below, baseline_ratio × transformers' own error at this dtype against fp32);
    # max argmax regret is bounded by twice the p99 bound (module doc).
    baseline_ratio: float | None
    mean_abs: float
    p99_abs: float
    min_top5_membership: float
    # two infer runs of one request that only differ in scheduling (chunking, batch neighbours)
    stream_logprob: float

    @property
    def tie(self) -> float:
        """A greedy divergence is accepted only where both streams' top-2 margins are at most this:
        2 × stream_logprob, the most per-token noise of that size can move a margin (module doc)."""
        return 2 * self.stream_logprob


FP32 = Tolerance(
    baseline_ratio=None,
    mean_abs=1e-4,
    p99_abs=1e-3,
    min_top5_membership=1.0,
    stream_logprob=1e-4,
)
BF16 = Tolerance(
    baseline_ratio=1.25,
    mean_abs=0.005,
    p99_abs=0.02,
    min_top5_membership=0.99,
    stream_logprob=0.1,
)


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    return FP32 if dtype == torch.float32 else BF16


def bf16_step(value: float) -> float:
    """The distance between adjacent bf16 numbers at |value| (8 significant bits)."""
    if value == 0 or not math.isfinite(value):
        raise ValueError(f"value={value!r}: needs a finite, non-zero number")
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


def for_logits(tolerance: Tolerance, top_logit: float) -> Tolerance:
    """`tolerance` with its stream bound (and so its tie bound) widened to LOGIT_STEPS bf16 steps
    at `top_logit`, the largest |logit| the checkpoint produces; fp32 bounds are left as they are."""
    if tolerance.baseline_ratio is None:
        return tolerance
    floor = LOGIT_STEPS * bf16_step(top_logit)
    return replace(tolerance, stream_logprob=max(tolerance.stream_logprob, floor))
