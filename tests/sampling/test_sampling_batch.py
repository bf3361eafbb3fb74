"""Packing per-row parameters, the eager plan, graph buffers, and input validation."""

from __future__ import annotations

import pytest
import torch

from engine.contract import SamplingParams
from engine.sampling import sample
from engine.sampling_batch import RowSampling, SamplingBatch, SamplingPlan


def test_pack_lays_out_rows_and_plans_the_cheapest_pass() -> None:
    rows = [
        RowSampling(SamplingParams(temperature=0.0, top_k=3, logprobs=2), seed=5, step=0),
        RowSampling(SamplingParams(temperature=0.5, min_p=0.1), seed=2**64 + 7, step=4),
        RowSampling(SamplingParams(temperature=1.5, top_p=0.9, logprobs=0), seed=2**63, step=9),
    ]
    batch = SamplingBatch.pack(rows)
    assert batch.floats.tolist() == [
        [1.0, 0.5, 1.5],
        [1.0, 1.0, pytest.approx(0.9)],
        [0.0, pytest.approx(0.1), 0.0],
    ]
    assert batch.ints.tolist() == [[3, 0, 0], [1, 0, 0], [5, 7, -(2**63)], [0, 4, 9]]
    assert batch.logprobs_requested == (2, None, 0)
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
