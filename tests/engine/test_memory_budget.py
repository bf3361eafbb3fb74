"""The KV budget arithmetic and the decode-graph buckets."""

from __future__ import annotations

import pytest

from engine.cuda_graphs import bucket_for, decode_buckets
from engine.memory_budget import GIB, MemoryBudget, MemoryBudgetError


def test_budget_subtracts_every_measured_term() -> None:
    budget = MemoryBudget(
        total=100 * GIB, utilization=0.9, weights=8 * GIB, activation_peak=2 * GIB, graphs=GIB
    )
    assert budget.kv_bytes == 79 * GIB
    assert budget.pages(GIB // 2) == 158
    assert "158 pages (2528 tokens)" in budget.describe(158, 16)


def test_other_resident_memory_comes_out_of_the_kv_cache() -> None:
    """The CUDA context, library memory and buffers start-up left are not weights, but the margin
    utilisation promises the rest of the device is measured against all of it."""
    budget = MemoryBudget(
        total=100 * GIB,
        utilization=0.9,
        weights=8 * GIB,
        activation_peak=2 * GIB,
        graphs=GIB,
        other_resident=GIB // 2,
    )
    assert budget.kv_bytes == 78 * GIB + GIB // 2
    assert "other resident 0.50 GiB" in budget.describe(1, 16)


def test_budget_that_cannot_hold_two_pages_names_every_term() -> None:
    budget = MemoryBudget(total=10 * GIB, utilization=0.9, weights=8 * GIB, activation_peak=GIB, graphs=0)
    with pytest.raises(MemoryBudgetError, match=r"weights 8\.00 GiB"):
        budget.pages(GIB)


def test_decode_buckets_follow_the_documented_ladder() -> None:
    assert decode_buckets(256) == (1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16))
    assert decode_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert decode_buckets(1000)[-1] == 256
    assert decode_buckets(1) == (1,)


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it() -> None:
    buckets = decode_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 17, 33, 64)] == [1, 4, 8, 24, 48, 64]
    assert bucket_for(65, buckets) is None
