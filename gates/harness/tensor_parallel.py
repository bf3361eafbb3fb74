"""Tensor parallelism against one rank on the same checkpoint: the `tp_matches_single` gate every
sharded line's suite runs, and the bound it (and tests/parallel) holds TP = N to
(docs/tensor-parallel.md).

The bound is measured in the same run, from the serving dtype's own error: TP = 1 at the serving
dtype against TP = 1 at the next wider dtype (fp32 against fp64 on the CPU, bf16 against fp32 on a
GPU), teacher-forced on the same tokens, gives the size of the error that reordering the serving
dtype's sums makes on this checkpoint. TP = N changes only the order of sums (the partial sums of
O, down and the embedding meet in an all-reduce), so its log-probs may differ from TP = 1's by at
most REORDERING_MULTIPLE times that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.contract import Request
from gates.harness.serving import (
    close_engine,
    drive,
    gate_tensor_parallel_size,
    greedy,
    load_for_gate,
    score,
)

# How many times the serving dtype's reordering error (max |Δ log-prob| of TP = 1 against TP = 1
# at the wider dtype) TP = N may differ from TP = 1 by. Measured in fp32 on the CPU (2026-12-04),
# 60 teacher-forced positions: the tiny synthetic Qwen3, Gemma 3 and Gemma 4 have a scale of
# 9.5e-7 to 1.4e-6 (one or two fp32 ulps of a log-prob between −16 and −8) and TP = 2 and 4 differ
# by 9.5e-7 to 1.4e-6, 1× the scale; on Gemma 3 270M's real weights the scale is 2.7e-5 and TP = 2
# differs by 3.1e-5, 1.14×. A wrong slice or a missing all-reduce moves log-probs by 1e-2 or more.
REORDERING_MULTIPLE = 4.0

# The dtype each serving dtype's reordering error is measured against.
WIDER_DTYPE = {torch.float32: "float64", torch.bfloat16: "float32", torch.float16: "float32"}


@dataclass(frozen=True, slots=True)
class ReorderingBound:
    """`scale`: max |Δ log-prob| of TP = 1 at the serving dtype against the wider dtype."""

    scale: float
    multiple: float = REORDERING_MULTIPLE

    @property
    def bound(self) -> float:
        return self.multiple * self.scale

    def describe(self) -> str:
        return f"bound {self.bound:.3g} = {self.multiple:g} × reordering scale {self.scale:.3g}"


def max_logprob_delta(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """Max |Δ| over the finite entries of two [positions, vocab] log-prob tensors; the entries that
    are -inf (suppressed ids) must be the same on both sides."""
    if candidate.shape != reference.shape:
        raise AssertionError(f"log-probs of shape {tuple(candidate.shape)} against {tuple(reference.shape)}")
    finite = reference.isfinite()
    if not torch.equal(finite, candidate.isfinite()):
        raise AssertionError("the two sides' -inf (suppressed) entries differ")
    return float((candidate.double() - reference.double())[finite].abs().max())


def reordering_bound(serving: torch.Tensor, wider: torch.Tensor) -> ReorderingBound:
    """The bound from one rank's log-probs at the serving dtype and at the wider dtype, same tokens."""
    scale = max_logprob_delta(serving, wider)
    if scale == 0.0:
        raise AssertionError("the wider dtype gave bit-identical log-probs: it did not run wider")
    return ReorderingBound(scale)


def check_tp_matches_single(
    checkpoint: Path,
    serving_dtype: torch.dtype,
    scored: Sequence[int],
    prompts: Sequence[Sequence[int]],
    new_tokens: int = 8,
) -> None:
    """TP = N (the run's size, at least 2) against TP = 1 on `checkpoint`: teacher-forced log-probs
    over `scored` within the bound measured here (module doc), and the greedy streams of `prompts`
    identical token for token, their log-probs within the same bound. A 32-token step budget
    splits a longer prompt into chunks prefilled beside the others' decodes. Any line's suite can
    call it with its own prompts."""
    ranks = max(2, gate_tensor_parallel_size())
    budget = 32
    tokens = list(scored)
    wide = load_for_gate(
        checkpoint, dtype=WIDER_DTYPE[serving_dtype], tensor_parallel_size=1, max_num_batched_tokens=budget
    )
    wider = score(wide, tokens)
    del wide
    single = load_for_gate(checkpoint, tensor_parallel_size=1, max_num_batched_tokens=budget)
    reference = score(single, tokens)
    measured = reordering_bound(reference, wider)
    sharded = load_for_gate(checkpoint, tensor_parallel_size=ranks, max_num_batched_tokens=budget)
    try:
        delta = max_logprob_delta(score(sharded, tokens), reference)
        print(
            f"TP = {ranks} against TP = 1, {len(tokens)} positions: max |Δ log-prob| {delta:.3g}; {measured.describe()}"
        )
        assert delta <= measured.bound, (
            f"TP = {ranks}: max |Δ log-prob| {delta:.3g} over the {measured.describe()}"
        )

        requests = [Request(f"tp{i}", tuple(p), greedy(new_tokens)) for i, p in enumerate(prompts)]
        want = drive(single, requests)
        got = drive(sharded, requests)
        for request in requests:
            rid = request.request_id
            a, b = got[rid], want[rid]
            assert len(a.tokens) == new_tokens, f"{rid}: TP = {ranks} produced {len(a.tokens)} tokens"
            assert a.tokens == b.tokens, f"{rid}: TP = {ranks} {a.tokens} against TP = 1 {b.tokens}"
            gap = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True))
            print(
                f"{rid} ({len(request.prompt_token_ids)}-token prompt): tokens equal, max |Δ log-prob| {gap:.3g}"
            )
            assert gap <= measured.bound, (
                f"{rid}: stream log-probs differ by {gap:.3g}; {measured.describe()}"
            )
        assert sharded.scheduler.load().kv_pages_used == 0, (
            "the sharded engine kept pages after its requests ended"
        )
    finally:
        close_engine(sharded)
