"""Packing per-row parameters, the eager plan, graph buffers, and input validation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.contract import SamplingParams
from engine.runner import BatchRow
from engine.sampling import sample
from engine.sampling_batch import (
    RowSampling,
    SamplingBatch,
    SamplingColumnsCache,
    SamplingPlan,
    SeedSource,
)


def test_pack_lays_out_rows_and_plans_the_cheapest_pass() -> None:
    rows = [
        RowSampling(SamplingParams(temperature=0.0, top_k=3, logprobs=2), seed=5, step=0),
        RowSampling(SamplingParams(temperature=0.5, min_p=0.1), seed=2**64 + 7, step=4),
        RowSampling(SamplingParams(temperature=1.5, top_p=0.9, logprobs=0), seed=2**63, step=9),
        RowSampling(SamplingParams(temperature=0.5), seed=-3, step=1),
    ]
    batch = SamplingBatch.pack(rows)
    assert batch.floats.tolist() == [
        [1.0, 0.5, 1.5, 0.5],
        [1.0, 1.0, pytest.approx(0.9), 1.0],
        [0.0, pytest.approx(0.1), 0.0, 0.0],
    ]
    assert batch.ints.tolist() == [[3, 0, 0, 0], [1, 0, 0, 0], [5, 7, -(2**63), -3], [0, 4, 9, 1]]
    assert batch.logprobs_requested == (2, None, 0, None)
    assert batch.plan == SamplingPlan(
        num_logprobs=2, sorted_filters=True, random_rows=True, min_p_filter=True
    )


def test_a_greedy_rows_filters_do_not_force_the_sort() -> None:
    rows = [
        RowSampling(SamplingParams(temperature=0.0, top_k=3, top_p=0.5), seed=0, step=0),
        RowSampling(SamplingParams(temperature=1.0, min_p=0.2), seed=0, step=0),
    ]
    assert SamplingBatch.pack(rows).plan == SamplingPlan(
        num_logprobs=None, sorted_filters=False, random_rows=True, min_p_filter=True
    )
    assert not SamplingBatch.pack(rows[:1]).plan.random_rows


def test_only_a_random_rows_min_p_runs_the_filter() -> None:
    rows = [
        RowSampling(SamplingParams(temperature=0.0, min_p=0.3), seed=0, step=0),
        RowSampling(SamplingParams(temperature=1.0, top_k=5), seed=0, step=0),
    ]
    assert SamplingBatch.pack(rows).plan == SamplingPlan(
        num_logprobs=None, sorted_filters=True, random_rows=True, min_p_filter=False
    )
    with_min_p = [*rows, RowSampling(SamplingParams(temperature=0.5, min_p=0.01), seed=0, step=0)]
    assert SamplingBatch.pack(with_min_p).plan.min_p_filter


def test_invalid_inputs_name_the_value() -> None:
    with pytest.raises(ValueError, match="rows=\\[\\]"):
        SamplingBatch.pack([])
    with pytest.raises(ValueError, match="step=-1"):
        RowSampling(SamplingParams(), seed=0, step=-1)
    with pytest.raises(ValueError, match="num_logprobs=-2"):
        SamplingPlan(num_logprobs=-2)
    params = SamplingBatch.pack([RowSampling(SamplingParams(), seed=0, step=0)] * 2).to("cpu")
    with pytest.raises(ValueError, match="3 rows"):
        sample(torch.zeros(3, 10), params, SamplingPlan())
    with pytest.raises(ValueError, match=r"logits.shape=\(10,\)"):
        sample(torch.zeros(10), params, SamplingPlan())
    with pytest.raises(ValueError, match="num_logprobs=11"):
        sample(torch.zeros(2, 10), params, SamplingPlan(num_logprobs=11))


def _step_rows() -> list[BatchRow]:
    """A step's rows: greedy and random, seeded and not, with and without log-probs, some that do
    not sample (a prefill chunk before the prompt's last)."""
    params = [
        SamplingParams(temperature=0.0, top_k=3, logprobs=2),
        SamplingParams(temperature=0.7, seed=2**64 + 11, min_p=0.05),
        SamplingParams(temperature=1.2, top_p=0.8, logprobs=0),
        SamplingParams(temperature=0.9, top_k=40),
        SamplingParams(temperature=1e-6),
    ]
    rows = []
    for i in range(12):
        sampling = params[i % len(params)]
        rows.append(BatchRow(f"req-{i}", (i,), 30 + i, ((1, 2),), i % 4 != 3, sampling, (i,), i * 3))
    return rows


def test_of_step_is_pack_of_each_sampling_rows_row_sampling() -> None:
    seeds = SeedSource()
    rows = _step_rows()
    want = SamplingBatch.pack([RowSampling.of(r, seeds) for r in rows if r.sample])
    got = SamplingBatch.of_step(rows, seeds)
    assert torch.equal(got.floats, want.floats) and got.floats.dtype == want.floats.dtype
    assert torch.equal(got.ints, want.ints) and got.ints.dtype == want.ints.dtype
    assert got.logprobs_requested == want.logprobs_requested
    assert got.plan == want.plan
    # The unseeded random rows got distinct seeds from their ids, the greedy ones none.
    assert got.num_rows == sum(r.sample for r in rows) == 9
    assert len({s for s, g in zip(got.ints[2].tolist(), got.ints[1].tolist(), strict=True) if not g}) > 1


def test_of_step_refuses_a_step_with_no_sampling_row_or_a_negative_step() -> None:
    rows = _step_rows()
    with pytest.raises(ValueError, match="no row samples"):
        SamplingBatch.of_step([r for r in rows if not r.sample], SeedSource())
    negative = replace(rows[0], num_generated=-1)
    with pytest.raises(ValueError, match="step=-1"):
        SamplingBatch.of_step([negative], SeedSource())


def _assert_same_batch(got: SamplingBatch, want: SamplingBatch) -> None:
    assert torch.equal(got.floats, want.floats) and got.floats.dtype == want.floats.dtype
    assert torch.equal(got.ints, want.ints) and got.ints.dtype == want.ints.dtype
    assert got.logprobs_requested == want.logprobs_requested
    assert got.plan == want.plan


def test_of_step_through_a_columns_cache_is_of_step_without_it() -> None:
    """Step after step through one cache, each batch equals the uncached one: the same rows again
    (reused, new step column), and every change a reuse must notice."""
    seeds = SeedSource()
    rows = _step_rows()
    later = [replace(r, num_generated=r.num_generated + 1) for r in rows]
    # A request replaced by another id with the same (unseeded, random) parameters: another seed.
    renamed = [replace(r, request_id="other") if i == 8 else r for i, r in enumerate(later)]
    # Equal parameters in new objects (as a tensor-parallel worker unpickles them): reusable.
    copied = [replace(r, sampling=replace(r.sampling)) for r in later]
    retuned = [
        replace(r, sampling=replace(r.sampling, temperature=0.3)) if i == 1 else r
        for i, r in enumerate(later)
    ]
    steps = {
        "first": (rows, seeds),
        "same rows, one more token": (later, seeds),
        "same rows again": (later, seeds),
        "another request id": (renamed, seeds),
        "reordered": (later[::-1], seeds),
        "a row left": (later[1:], seeds),
        "a row that no longer samples": ([replace(later[0], sample=False), *later[1:]], seeds),
        "equal parameters, new objects": (copied, seeds),
        "changed parameters": (retuned, seeds),
        "another seed source": (retuned, SeedSource()),
    }
    columns = SamplingColumnsCache()
    handed_out = []
    for name, (step_rows, step_seeds) in steps.items():
        got = SamplingBatch.of_step(step_rows, step_seeds, columns)
        want = SamplingBatch.of_step(step_rows, step_seeds)
        try:
            _assert_same_batch(got, want)
        except AssertionError as error:
            raise AssertionError(name) from error
        handed_out.append((got, want))
        # A batch handed out is the caller's: writing into it changes no later batch.
        got.floats.fill_(-1.0)
        got.ints.fill_(-1)
    assert len({id(got.ints) for got, _ in handed_out}) == len(steps)
