"""Log-probs are the raw model distribution's: log_softmax of the unscaled, unfiltered logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sampler_testkit import run_sampler

from engine.contract import SamplingParams
from engine.sampling import SamplerOutput, sample
from engine.sampling_batch import RowSampling, SamplingBatch, SamplingPlan


def _rows(count: int, **params: Any) -> list[RowSampling]:
    return [RowSampling(SamplingParams(**params), seed=i, step=0) for i in range(count)]


@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
@pytest.mark.parametrize("vocab", [7, 1001, 32000])
def test_logprobs_equal_log_softmax(device: str, scale: float, vocab: int) -> None:
    generator = torch.Generator().manual_seed(20)
    logits = (torch.randn(6, vocab, generator=generator) * scale).to(device)
    output = run_sampler(logits, _rows(6, temperature=0.8, top_p=0.9, logprobs=5))
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert output.logprobs is not None and output.top_ids is not None and output.top_logprobs is not None

    chosen_reference = reference.gather(1, output.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(output.logprobs.double(), chosen_reference, atol=2e-6, rtol=1e-6)
    top_reference = torch.sort(reference, dim=-1, descending=True, stable=True)
    assert torch.equal(output.top_ids, top_reference.indices[:, :5])
    torch.testing.assert_close(
        output.top_logprobs.double(), top_reference.values[:, :5], atol=2e-6, rtol=1e-6
    )


def test_logprobs_are_raw_not_tempered_or_filtered(device: str) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], device=device).expand(200, -1)
    output = run_sampler(logits, _rows(200, temperature=0.3, top_k=2, logprobs=4))
    raw = torch.log_softmax(logits[0].double(), dim=-1).float().cpu()
    assert output.top_logprobs is not None and output.logprobs is not None
    torch.testing.assert_close(output.top_logprobs[0].cpu(), raw, atol=1e-6, rtol=0)
    # Tokens 2 and 3 are filtered out of the draw but still reported among the alternatives.
    assert output.top_ids is not None and output.top_ids[0].tolist() == [0, 1, 2, 3]
    assert set(output.token_ids.tolist()) == {0, 1}
    torch.testing.assert_close(output.logprobs.cpu(), raw[output.token_ids.cpu()], atol=1e-6, rtol=0)


def test_bf16_logits_give_the_float32_logprobs(device: str) -> None:
    generator = torch.Generator().manual_seed(21)
    logits = torch.randn(3, 257, generator=generator).to(device).bfloat16()
    rows = _rows(3, temperature=0.0, logprobs=3)
    from_bf16 = run_sampler(logits, rows)
    from_float = run_sampler(logits.float(), rows)
    assert from_bf16.top_logprobs is not None and from_float.top_logprobs is not None
    assert torch.equal(from_bf16.token_ids, from_float.token_ids)
    assert torch.equal(from_bf16.top_logprobs, from_float.top_logprobs)


def test_tied_alternatives_are_ordered_by_lower_id(device: str) -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -float("inf")]], device=device)
    output = run_sampler(logits, _rows(1, temperature=0.0, logprobs=6))
    assert output.top_ids is not None and output.top_logprobs is not None
    assert output.top_ids[0].tolist() == [1, 2, 4, 3, 0, 5]
    assert output.top_logprobs[0, -1].item() == -float("inf")
    assert output.token_ids.tolist() == [1]


def test_to_sampled_tokens_slices_each_rows_request() -> None:
    logits = torch.tensor([[0.0, 4.0, 1.0, 2.0]] * 5)
    requested = [None, 0, 2, 3]
    rows = [RowSampling(SamplingParams(temperature=0.0, logprobs=k), seed=0, step=0) for k in requested]
    batch = SamplingBatch.pack(rows)
    # A fifth (padding) row beyond the requests is dropped.
    output = sample(logits, SamplingBatch.pack([*rows, rows[0]]).to("cpu"), batch.plan)
    tokens = output.to_sampled_tokens(batch.logprobs_requested)
    raw = torch.log_softmax(logits[0], dim=-1).tolist()

    assert [t.token_id for t in tokens] == [1, 1, 1, 1]
    assert tokens[0].logprob is None
    assert tokens[1].logprob is not None
    assert (tokens[1].logprob.token_id, tokens[1].logprob.top) == (1, ())
    assert tokens[1].logprob.logprob == pytest.approx(raw[1])
    assert tokens[2].logprob is not None
    assert [token_id for token_id, _ in tokens[2].logprob.top] == [1, 3]
    assert tokens[3].logprob is not None
    assert [token_id for token_id, _ in tokens[3].logprob.top] == [1, 3, 2]
    assert tokens[3].logprob.top[2][1] == pytest.approx(raw[2])


def test_to_sampled_tokens_refuses_what_was_not_computed() -> None:
    output = SamplerOutput(torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="without them"):
        output.to_sampled_tokens([None, 0])
    with_top = sample(torch.zeros(1, 8), SamplingBatch.pack(_rows(1)).to("cpu"), SamplingPlan(num_logprobs=2))
    with pytest.raises(ValueError, match="asks for 5"):
        with_top.to_sampled_tokens([5])
    with pytest.raises(ValueError, match="3 rows"):
        output.to_sampled_tokens([None, None, None])
