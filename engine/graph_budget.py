"""Decode-graph memory in the KV budget: which buckets fit, and how the reserved figure compares.

Pure arithmetic over measured per-bucket figures (infer_cli.bench.bucket_sweep and the start-up trial capture
produce them); nothing here touches a device, so the start-up refusal is unit-tested on the CPU.

A bucket's capture costs two kinds of memory, both seen as a drop in free device memory:
  * growth of the shared pool the torch allocator holds for every graph (activations; set mostly
    by the largest bucket, which is captured first), and
  * memory outside the allocator that the graph itself holds (its nodes and their parameters once
    instantiated), which grows with the graph's node count: O(layers) per bucket for `tuned` and
    `invariant`, O(layers × rows) for `per-token`.
The cost of capturing every bucket up to B is taken as the whole measured pool plus the outside
memory of each bucket ≤ B. The pool a smaller top bucket needs is no larger than the measured one,
so this over-states, never under-states, what a smaller set needs: a bucket said to fit does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.memory_budget import GIB, MemoryBudgetError


@dataclass(frozen=True, slots=True)
class BucketMemory:
    bucket: int
    # Drop in free device memory across the bucket's capture.
    device_bytes: int
    # Growth of the allocator's reserved memory (the shared graph pool) across the capture.
    pool_bytes: int

    def __post_init__(self) -> None:
        if self.bucket < 1:
            raise ValueError(f"bucket={self.bucket}: must be at least 1")

    @property
    def outside_pool_bytes(self) -> int:
        """Memory the graph holds outside the torch allocator (never negative)."""
        return max(0, self.device_bytes - self.pool_bytes)


def _by_bucket(records: Sequence[BucketMemory]) -> list[BucketMemory]:
    ordered = sorted(records, key=lambda r: r.bucket)
    seen = [r.bucket for r in ordered]
    if len(set(seen)) != len(seen):
        raise ValueError(f"buckets {seen}: each bucket must be measured once")
    return ordered


def graph_bytes_up_to(records: Sequence[BucketMemory], top: int) -> int:
    """Bytes to capture every measured bucket ≤ `top` (see the module doc for why this is an upper bound)."""
    ordered = _by_bucket(records)
    pool = sum(max(0, r.pool_bytes) for r in ordered)
    return pool + sum(r.outside_pool_bytes for r in ordered if r.bucket <= top)


@dataclass(frozen=True, slots=True)
class GraphFit:
    """Which buckets fit in `available` bytes, smallest first."""

    fitting: tuple[int, ...]
    refused: tuple[int, ...]
    available: int
    needed: int  # bytes for every measured bucket

    @property
    def largest(self) -> int | None:
        return self.fitting[-1] if self.fitting else None

    @property
    def all_fit(self) -> bool:
        return not self.refused


def fit_buckets(records: Sequence[BucketMemory], available: int) -> GraphFit:
    ordered = _by_bucket(records)
    if not ordered:
        return GraphFit((), (), available, 0)
    fitting = tuple(r.bucket for r in ordered if graph_bytes_up_to(ordered, r.bucket) <= available)
    # Cumulative cost grows with the bucket, so what fits is a prefix.
    refused = tuple(r.bucket for r in ordered if r.bucket not in fitting)
    return GraphFit(fitting, refused, available, graph_bytes_up_to(ordered, ordered[-1].bucket))


def graphs_available(
    total: int, utilization: float, weights: int, activation_peak: int, min_kv_bytes: int
) -> int:
    """Bytes the graphs may take: utilisation × total − weights − activation peak − the smallest KV pool."""
    return int(total * utilization) - weights - activation_peak - min_kv_bytes


def require_fit(records: Sequence[BucketMemory], available: int, policy: str) -> GraphFit:
    """The fit, or a `MemoryBudgetError` at start-up naming the largest bucket that fits."""
    fit = fit_buckets(records, available)
    if fit.all_fit:
        return fit
    top = fit.refused[-1]
    head = (
        f"decode graphs up to bucket {top} under numeric policy {policy!r} need "
        f"{fit.needed / GIB:.2f} GiB, but {available / GIB:.2f} GiB is left after weights, activations "
        f"and the smallest KV pool"
    )
    if fit.largest is None:
        raise MemoryBudgetError(
            f"{head}; not even bucket {fit.refused[0]} fits: use --enforce-eager, another numeric "
            f"policy, or a higher --gpu-memory-utilization"
        )
    raise MemoryBudgetError(
        f"{head}; the largest bucket that fits is {fit.largest}: pass --max-num-seqs {fit.largest}, "
        f"use another numeric policy, or --enforce-eager"
    )


@dataclass(frozen=True, slots=True)
class ReserveCheck:
    """The graph memory the budget reserved against what the graphs took."""

    reserved: int
    measured: int

    @property
    def diff_pct(self) -> float:
        """(reserved − measured) / measured in percent: positive when the budget over-reserves."""
        if self.measured == 0:
            return 0.0 if self.reserved == 0 else math.inf
        return 100.0 * (self.reserved - self.measured) / self.measured

    def within(self, pct: float) -> bool:
        return abs(self.diff_pct) <= pct


def capture_out_of_memory(
    failed: int, captured: Sequence[int], policy: str, kind: str = "decode"
) -> MemoryBudgetError:
    """The start-up refusal for a trial capture that ran out of device memory at bucket `failed`
    (after `captured`, the larger buckets, in one pool): an error naming what to change, where the
    trial would otherwise end start-up with a bare out-of-memory error. `kind`: "decode" (buckets
    of rows) or "prefill" (buckets of tokens)."""
    before = f" after buckets {', '.join(map(str, captured))} (captured largest first)" if captured else ""
    fewer = (
        "Capture fewer rows (a smaller --max-num-seqs; with bench --buckets, a shorter bucket list)"
        if kind == "decode"
        else "Capture fewer tokens (a smaller --max-num-batched-tokens) or leave out --prefill-graphs"
    )
    return MemoryBudgetError(
        f"{kind} graph capture under numeric policy {policy!r} ran out of device memory at bucket "
        f"{failed}{before}, before the KV pool was sized: these graphs do not fit beside the "
        f"weights. {fewer}, use another numeric policy, or --enforce-eager"
    )
