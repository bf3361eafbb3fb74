"""The batch-invariance gate every model suite runs: one request alone, then inside batches that land
on every captured decode bucket, must give the same tokens and log-probs bit for bit.

A batch of size B is the target plus B − 1 neighbours with different prompts of the same length and
the same number of new tokens, all submitted together. So they prefill in one step (the token budget
is raised to hold every prompt; prefill planning sees the same per-request query length as alone)
and decode in lock step, every decode step exactly B rows: a graph of bucket B when B is a bucket.
The target sits in the middle of its batch, so neither the first nor the last row is all that is
checked. Prefix caching is off: a hit would send the target down another path than alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.contract import Request, TokenLogprob
from engine.cuda_graphs import decode_buckets
from gates.harness.serving import drive, greedy, load_for_gate, paged_runner, random_prompt
from models.registry import LoadedModel

# The end-to-end invariant policies, each with the largest bucket its run captures and checks. The
# `invariant` graphs have O(layers) GEMM nodes, so capturing every bucket up to the engine's 256 is
# cheap. `per-token` graphs grow with the bucket (layers × projections × B GEMM nodes): capturing
# them past 64 on a 12B model costs minutes and gigabytes, so its run stops at 64 — every bucket up
# to 64 is still captured and checked (manifests say so in the gates' `why`).
POLICY_TOP_BUCKET: dict[str, int] = {"invariant": 256, "per-token": 64}

PROMPT_TOKENS = 8
NEW_TOKENS = 4
TOP_LOGPROBS = 5


class InvarianceError(AssertionError):
    """A row that changed with its batch, or a step that did not run the graph it was meant to."""


@dataclass(frozen=True, slots=True)
class TargetRun:
    """What the target request produced in one run, floats as their exact hex spelling."""

    batch: int
    tokens: tuple[int, ...]
    logprobs: tuple[tuple[int, str, tuple[tuple[int, str], ...]], ...]


def _exact(logprobs: Sequence[TokenLogprob]) -> tuple[tuple[int, str, tuple[tuple[int, str], ...]], ...]:
    # float.hex tells -0.0 from 0.0 and every ulp apart, as a bit comparison would.
    return tuple(
        (lp.token_id, float(lp.logprob).hex(), tuple((t, float(v).hex()) for t, v in lp.top))
        for lp in logprobs
    )


def batch_requests(batch: int, vocab_size: int, avoid: Sequence[int] = ()) -> tuple[list[Request], str]:
    """The target and `batch - 1` neighbours in submission order, and the target's request id."""
    params = greedy(NEW_TOKENS, logprobs=TOP_LOGPROBS)
    target = Request(f"target-in-{batch}", random_prompt(PROMPT_TOKENS, 7, vocab_size, avoid), params)
    neighbours = [
        Request(f"neighbour-{batch}-{i}", random_prompt(PROMPT_TOKENS, 1000 + i, vocab_size, avoid), params)
        for i in range(batch - 1)
    ]
    middle = len(neighbours) // 2
    return [*neighbours[:middle], target, *neighbours[middle:]], target.request_id


def run_target(model: LoadedModel, batch: int, vocab_size: int, avoid: Sequence[int] = ()) -> TargetRun:
    requests, target_id = batch_requests(batch, vocab_size, avoid)
    done = drive(model, requests)[target_id]
    if len(done.tokens) != NEW_TOKENS:
        raise InvarianceError(
            f"batch {batch}: the target produced {len(done.tokens)} tokens, not {NEW_TOKENS}"
        )
    return TargetRun(batch, tuple(done.tokens), _exact(done.logprobs))


def compare_to_alone(alone: TargetRun, batched: TargetRun, policy: str) -> None:
    if batched.tokens != alone.tokens:
        raise InvarianceError(
            f"{policy}: the target's tokens in a batch of {batched.batch} are {batched.tokens}, "
            f"alone {alone.tokens}"
        )
    for step, (got, want) in enumerate(zip(batched.logprobs, alone.logprobs, strict=True)):
        if got != want:
            raise InvarianceError(
                f"{policy}: token {step} of the target differs in a batch of {batched.batch}: "
                f"{got} vs alone {want}"
            )


def load_invariant(checkpoint: Path, policy: str, top_bucket: int) -> LoadedModel:
    """The model as the gate serves it: `policy`, graphs on, buckets up to `top_bucket`, every batch's
    prompts prefilled in one step, no prefix cache."""
    return load_for_gate(
        checkpoint,
        numeric_policy=policy,
        max_num_seqs=top_bucket,
        max_num_batched_tokens=max(2048, top_bucket * PROMPT_TOKENS),
        enable_prefix_caching=False,
    )


def check_batch_invariance(
    model: LoadedModel, policy: str, batches: Sequence[int], vocab_size: int, avoid: Sequence[int] = ()
) -> list[int]:
    """Target alone, then in each batch size; returns the batch sizes whose decode steps replayed a
    graph of exactly that bucket (every one of `batches` when the model has graphs)."""
    graphs = paged_runner(model).graphs
    alone = run_target(model, 1, vocab_size, avoid)
    replayed: list[int] = []
    for batch in batches:
        before = dict(graphs.replays_per_bucket) if graphs is not None else {}
        compare_to_alone(alone, run_target(model, batch, vocab_size, avoid), policy)
        if (
            graphs is not None
            and graphs.replays_per_bucket.get(batch, 0) - before.get(batch, 0) >= NEW_TOKENS - 1
        ):
            replayed.append(batch)
    return replayed


def check_batch_invariance_on_every_bucket(
    checkpoint: Path, vocab_size: int, avoid: Sequence[int] = ()
) -> None:
    """For each end-to-end invariant policy: load with graphs, compare alone against every captured
    bucket size, and require that each of those batches' decode steps replayed its bucket's graph."""
    for policy, top in POLICY_TOP_BUCKET.items():
        model = load_invariant(checkpoint, policy, top)
        graphs = paged_runner(model).graphs
        if graphs is None:
            raise InvarianceError(f"{policy}: the model started without CUDA graphs")
        buckets = graphs.buckets
        if buckets != decode_buckets(top):
            raise InvarianceError(f"{policy}: captured buckets {buckets}, expected {decode_buckets(top)}")
        replayed = check_batch_invariance(model, policy, [b for b in buckets if b > 1], vocab_size, avoid)
        if graphs.replays_per_bucket[1] < NEW_TOKENS - 1:
            raise InvarianceError(
                f"{policy}: the target alone did not replay bucket 1: {graphs.replays_per_bucket}"
            )
        missing = [b for b in buckets if b > 1 and b not in replayed]
        if missing:
            raise InvarianceError(
                f"{policy}: batches of {missing} did not replay their own bucket's graph "
                f"(replays per bucket {graphs.replays_per_bucket})"
            )
        del model, graphs
        torch.cuda.empty_cache()
