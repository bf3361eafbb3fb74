"""Comparing two models' log-probs, and two token streams, with named tolerances."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.contract import TokenLogprob
from gates.harness.tolerances import Tolerance


@dataclass(frozen=True, slots=True)
class LogprobDelta:
    """Teacher-forced comparison over positions: |Δ log-prob| of the actual next tokens, how often
    the two argmaxes agree, and the worst argmax regret (log-prob the reference loses by taking
    the candidate's argmax instead of its own)."""

    positions: int
    mean_abs: float
    p99_abs: float
    max_abs: float
    argmax_agreement: float
    max_regret: float
    top5_membership: float

    def describe(self) -> str:
        return (
            f"{self.positions} positions: mean |Δ| {self.mean_abs:.3g}, p99 {self.p99_abs:.3g}, max {self.max_abs:.3g}, "
            f"argmax agreement {self.argmax_agreement:.4f}, max regret {self.max_regret:.3g}, "
            f"top-5 membership {self.top5_membership:.4f}"
        )


def logprob_delta(candidate: torch.Tensor, reference: torch.Tensor, token_ids: Sequence[int]) -> LogprobDelta:
    """`candidate`, `reference`: [n, vocab] log-probs at positions 0..n-1 of `token_ids`."""
    n = len(token_ids)
    cand, ref = candidate[: n - 1].float().cpu(), reference[: n - 1].float().cpu()
    targets = torch.tensor(list(token_ids[1:]))[:, None]
    delta = (cand.gather(1, targets) - ref.gather(1, targets)).abs().squeeze(1)
    cand_arg = cand.argmax(-1)
    ref_best = ref.max(-1).values
    regret = ref_best - ref.gather(1, cand_arg[:, None]).squeeze(1)
    top5 = ref.topk(5, dim=-1).indices
    member = (top5 == cand_arg[:, None]).any(-1)
    return LogprobDelta(
        positions=n - 1,
        mean_abs=float(delta.mean()),
        p99_abs=float(delta.quantile(0.99)),
        max_abs=float(delta.max()),
        argmax_agreement=float((cand_arg == ref.argmax(-1)).float().mean()),
        max_regret=float(regret.max()),
        top5_membership=float(member.float().mean()),
    )


def assert_parity(candidate: LogprobDelta, baseline: LogprobDelta | None, tol: Tolerance) -> None:
    """`candidate`: infer against the fp32 reference. `baseline`: transformers at infer's dtype
    against the same reference (None when infer runs fp32: then the bounds are absolute)."""

    def bound(floor: float, measured: float | None) -> float:
        if tol.baseline_ratio is None or measured is None:
            return floor
        return max(floor, tol.baseline_ratio * measured)

    where = candidate.describe() + (
        f" | transformers at this dtype: {baseline.describe()}" if baseline else ""
    )
    mean_bound = bound(tol.mean_abs, baseline.mean_abs if baseline else None)
    p99_bound = bound(tol.p99_abs, baseline.p99_abs if baseline else None)
    # What noise within the p99 bound on both of two parting argmaxes can cost (tolerances.py).
    regret_bound = 2 * p99_bound
    assert candidate.mean_abs <= mean_bound, f"mean |Δ| over {mean_bound:.3g}: {where}"
    assert candidate.p99_abs <= p99_bound, f"p99 |Δ| over {p99_bound:.3g}: {where}"
    assert candidate.max_regret <= regret_bound, f"max regret over {regret_bound:.3g}: {where}"
    assert candidate.top5_membership >= tol.min_top5_membership, f"top-5 membership: {where}"


def assert_full_forward_parity(
    candidate_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    baseline_logprobs: torch.Tensor | None,
    token_ids: Sequence[int],
    tol: Tolerance,
) -> None:
    """Teacher-forced parity as every model suite gates it: infer's log-probs against the fp32
    reference, judged against transformers' own error at the serving dtype (None on fp32)."""
    candidate = logprob_delta(candidate_logprobs, reference_logprobs, token_ids)
    baseline = (
        None if baseline_logprobs is None else logprob_delta(baseline_logprobs, reference_logprobs, token_ids)
    )
    print("infer:", candidate.describe())
    if baseline is not None:
        print("transformers at the serving dtype:", baseline.describe())
    assert_parity(candidate, baseline, tol)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_streams_agree(
    name: str,
    a_tokens: Sequence[int],
    a_logprobs: Sequence[TokenLogprob],
    b_tokens: Sequence[int],
    b_logprobs: Sequence[TokenLogprob],
    logprob_tol: float,
    tie_tol: float,
) -> None:
    """Two greedy streams of one request agree: equal tokens with log-probs within `logprob_tol`,
    except that they may part at a near-tie — where each stream's own top two candidates are within
    `tie_tol` of each other — after which nothing more is compared. tie_tol = 0 demands identity."""
    diverge = first_divergence(a_tokens, b_tokens)
    upto = len(a_tokens) if diverge is None else diverge
    gaps = [abs(a_logprobs[i].logprob - b_logprobs[i].logprob) for i in range(upto)]
    # Said before judging, so a passing run on a new checkpoint still records what the bounds cover.
    worst = max(range(upto), key=gaps.__getitem__, default=None)
    print(
        f"{name}: {upto} equal tokens"
        + ("" if worst is None else f", max |Δ log-prob| {gaps[worst]:.3g} at token {worst}")
        + ("" if diverge is None else f"; streams part at token {diverge}")
        + f" (bounds {logprob_tol}, tie {tie_tol})"
    )
    for i, gap in enumerate(gaps):
        assert gap <= logprob_tol, f"{name}: token {i}: log-prob differs by {gap:.3g} > {logprob_tol}"
    if diverge is None:
        return
    assert diverge < len(a_tokens) and diverge < len(b_tokens), f"{name}: streams have different lengths"
    for label, lps in (("first", a_logprobs), ("second", b_logprobs)):
        top = lps[diverge].top
        assert len(top) >= 2, f"{name}: token {diverge}: needs top log-probs to judge a divergence"
        margin = top[0][1] - top[1][1]
        assert margin <= tie_tol, (
            f"{name}: streams part at token {diverge} ({a_tokens[diverge]} vs {b_tokens[diverge]}) where the "
            f"{label} stream's top-2 margin is {margin:.3g} > {tie_tol}: not a near-tie"
        )
