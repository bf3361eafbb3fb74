"""Greedy, temperature and the top-k / top-p / min-p filters against closed-form expectations."""

from __future__ import annotations

import pytest
import torch
from sampler_testkit import logits_from_probs, run_sampler, same_params_rows

from engine.contract import SamplingParams
from engine.sampling import allowed_tokens
from engine.sampling_batch import RowSampling, SamplingBatch

PROBS = [0.4, 0.3, 0.2, 0.06, 0.04]


def _allowed_set(probs: list[float], params: SamplingParams, device: str) -> set[int]:
    logits = logits_from_probs(probs, device)
    batch = SamplingBatch.pack([RowSampling(params, seed=0, step=0)])
    scaled = logits / params.temperature
    mask = allowed_tokens(scaled, batch.to(device))
    return {int(i) for i in mask[0].nonzero().flatten()}


def _drawn_set(probs: list[float], params: SamplingParams, device: str, draws: int = 3000) -> set[int]:
    logits = logits_from_probs(probs, device).expand(draws, -1)
    tokens = run_sampler(logits, same_params_rows(params, draws, seed=11)).token_ids
    return set(tokens.tolist())


def test_greedy_is_argmax(device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(32, 700, generator=generator) * 4).to(device)
    rows = [
        RowSampling(SamplingParams(temperature=0.0, top_k=5, top_p=0.5), seed=i, step=i) for i in range(32)
    ]
    assert torch.equal(run_sampler(logits, rows).token_ids, logits.argmax(dim=-1))


def test_greedy_ties_go_to_the_lowest_id(device: str) -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, -2.0, 3.0, 3.0]], device=device)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)):
        assert run_sampler(logits, [RowSampling(params, 5, 0)]).token_ids.tolist() == [2]


def test_temperature_below_epsilon_is_greedy() -> None:
    batch = SamplingBatch.pack([RowSampling(SamplingParams(temperature=1e-7), 0, 0)])
    assert batch.ints[1].tolist() == [1]
    assert batch.floats[0].tolist() == [1.0]  # the division never sees the tiny temperature
    assert not batch.plan.random_rows


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_top_k_one_is_greedy(device: str, temperature: float) -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 300, generator=generator).to(device).expand(400, -1)
    rows = same_params_rows(SamplingParams(temperature=temperature, top_k=1), 400, seed=3)
    assert torch.equal(run_sampler(logits, rows).token_ids, logits.argmax(dim=-1))


def test_tiny_top_p_is_greedy(device: str) -> None:
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 300, generator=generator).to(device).expand(400, -1)
    rows = same_params_rows(SamplingParams(temperature=1.0, top_p=1e-6), 400, seed=5, by="seed")
    assert torch.equal(run_sampler(logits, rows).token_ids, logits.argmax(dim=-1))


def test_temperature_to_zero_converges_to_argmax(device: str) -> None:
    # Logits 0.5 apart: at T=0.01 any other token is e^-50 less likely than the best.
    logits = (
        (torch.arange(20, dtype=torch.float32, device=device) * 0.5).flip(0).unsqueeze(0).expand(2000, -1)
    )
    argmax_share = []
    for temperature in (2.0, 1.0, 0.3, 0.1, 0.01):
        rows = same_params_rows(SamplingParams(temperature=temperature), 2000, seed=6)
        tokens = run_sampler(logits, rows).token_ids
        argmax_share.append(float((tokens == 0).double().mean()))
    assert argmax_share == sorted(argmax_share)
    assert argmax_share[0] < 0.5
    assert argmax_share[-1] == 1.0


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # min-p keeps probability >= min_p * 0.4
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # threshold 0.08
        (SamplingParams(min_p=0.6), {0, 1}),  # threshold 0.24
        (SamplingParams(min_p=0.12), {0, 1, 2, 3}),  # threshold 0.048
        (SamplingParams(min_p=1.0), {0}),
        # At T=2 the relative probabilities are sqrt(p / 0.4): 1, .87, .71, .39, .32.
        (SamplingParams(temperature=2.0, min_p=0.35), {0, 1, 2, 3}),
        # top-k
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=50), {0, 1, 2, 3, 4}),
        # top-p: mass before each token is 0, .4, .7, .9, .96
        (SamplingParams(top_p=0.35), {0}),
        (SamplingParams(top_p=0.5), {0, 1}),
        (SamplingParams(top_p=0.75), {0, 1, 2}),
        (SamplingParams(top_p=0.95), {0, 1, 2, 3}),
        # top-p sees top-k's renormalised distribution: over {0, 1} the mass before 1 is 4/7.
        (SamplingParams(top_k=2, top_p=0.45), {0}),
        (SamplingParams(top_k=2, top_p=0.6), {0, 1}),
        # All three: top-p keeps {0..3}, min-p 0.2 cuts to {0, 1, 2}.
        (SamplingParams(top_k=4, top_p=0.95, min_p=0.2), {0, 1, 2}),
    ],
)
def test_filters_keep_the_closed_form_set(device: str, params: SamplingParams, expected: set[int]) -> None:
    assert _allowed_set(PROBS, params, device) == expected
    # Draws stay inside the set and reach all of it.
    assert _drawn_set(PROBS, params, device) == expected


def test_top_k_ties_at_the_cut_keep_lower_ids(device: str) -> None:
    probs = [0.1, 0.3, 0.2, 0.2, 0.2]
    assert _allowed_set(probs, SamplingParams(top_k=2), device) == {1, 2}
    assert _allowed_set(probs, SamplingParams(top_k=3), device) == {1, 2, 3}


def test_draws_never_leave_the_allowed_set(device: str) -> None:
    """Random logits and parameters; every draw over many seeds must be an allowed token."""
    generator = torch.Generator().manual_seed(7)
    rows_count, vocab = 3000, 64
    logits = (torch.randn(rows_count, vocab, generator=generator) * 2).to(device)
    rows = []
    for i in range(rows_count):
        top_k, top_p, min_p, temperature = (
            int(torch.randint(0, 10, (1,), generator=generator)),
            float(torch.empty(1).uniform_(0.05, 1.0, generator=generator)),
            float(torch.empty(1).uniform_(0.0, 0.5, generator=generator)),
            float(torch.empty(1).uniform_(0.2, 2.0, generator=generator)),
        )
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        rows.append(RowSampling(params, seed=i * 7919, step=i % 13))
    batch = SamplingBatch.pack(rows)
    params_on_device = batch.to(device)
    tokens = run_sampler(logits, rows).token_ids
    allowed = allowed_tokens(logits / params_on_device.temperature.unsqueeze(1), params_on_device)
    assert bool(allowed.gather(1, tokens.unsqueeze(1)).all())
    # The filters did cut: most rows allow only part of the vocabulary, yet draws vary.
    assert float(allowed.double().mean()) < 0.5
    assert (tokens != logits.argmax(dim=-1)).any()
