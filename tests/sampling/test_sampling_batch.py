"""Packing per-row parameters, the eager plan, graph buffers, and input validation."""

from __future__ import annotations

import pytest
import torch

from engine.contract import SamplingParams
from engine.sampling import sample
from engine.sampling_batch import RowSampling, SamplingBatch, SamplingBuffers, SamplingPlan


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
    assert batch.plan == SamplingPlan(num_logprobs=2, sorted_filters=True, random_rows=True)


def test_a_greedy_rows_filters_do_not_force_the_sort() -> None:
    rows = [
        RowSampling(SamplingParams(temperature=0.0, top_k=3, top_p=0.5), seed=0, step=0),
        RowSampling(SamplingParams(temperature=1.0, min_p=0.2), seed=0, step=0),
    ]
    assert SamplingBatch.pack(rows).plan == SamplingPlan(
        num_logprobs=None, sorted_filters=False, random_rows=True
    )
    assert not SamplingBatch.pack(rows[:1]).plan.random_rows


def test_plan_coverage() -> None:
    graph = SamplingPlan.for_graph(num_logprobs=5)
    assert graph.covers(SamplingPlan(num_logprobs=5, sorted_filters=False, random_rows=False))
    assert not graph.covers(SamplingPlan(num_logprobs=6))
    assert not SamplingPlan.for_graph(None).covers(SamplingPlan(num_logprobs=0))
    assert not SamplingPlan(sorted_filters=False).covers(SamplingPlan())


def test_buffers_keep_their_storage_and_pad_with_greedy_rows(device: str) -> None:
    buffers = SamplingBuffers(max_rows=8, device=device)
    pointers = (buffers.floats.data_ptr(), buffers.ints.data_ptr())
    full = SamplingBatch.pack([RowSampling(SamplingParams(top_k=2), seed=3, step=1)] * 8)
    full.copy_into(buffers)
    view = SamplingBatch.pack([RowSampling(SamplingParams(top_p=0.5), seed=4, step=2)] * 3).copy_into(
        buffers, 6
    )

    assert (buffers.floats.data_ptr(), buffers.ints.data_ptr()) == pointers
    assert view.temperature.data_ptr() == buffers.floats.data_ptr()
    assert view.num_rows == 6
    assert view.top_p.tolist() == [0.5, 0.5, 0.5, 1.0, 1.0, 1.0]
    assert view.greedy.tolist() == [0, 0, 0, 1, 1, 1]
    assert view.top_k.tolist() == [0] * 6
    # Rows past the bucket keep what an earlier step wrote; the bucket's graph never reads them.
    assert buffers.ints[0, 6:].tolist() == [2, 2]


def test_copy_into_refuses_a_bucket_that_does_not_fit(device: str) -> None:
    buffers = SamplingBuffers(max_rows=4, device=device)
    batch = SamplingBatch.pack([RowSampling(SamplingParams(), seed=0, step=0)] * 3)
    with pytest.raises(ValueError, match="padded_rows=2"):
        batch.copy_into(buffers, padded_rows=2)
    with pytest.raises(ValueError, match="padded_rows=5"):
        batch.copy_into(buffers, padded_rows=5)
    with pytest.raises(ValueError, match="num_rows=0"):
        buffers.view(0)


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
