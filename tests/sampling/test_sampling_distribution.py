"""Seeded draws follow the filtered softmax; the counter-based noise is uniform and uncorrelated.

Every draw is keyed by fixed seeds and steps, so each statistic is a fixed number: these tests
pass or fail deterministically. The bounds are chi-square critical values at the 0.1 % level.
"""

from __future__ import annotations

import math

import pytest
import torch
from sampler_testkit import chi_square, chi_square_critical, logits_from_probs, run_sampler, same_params_rows

from engine.contract import SamplingParams
from kernels.reference import gumbel_noise, mix_words, uniform_noise

DRAWS = 20_000


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.cpu(), minlength=vocab)


@pytest.mark.parametrize("by", ["step", "seed"])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_draws_match_the_tempered_softmax(device: str, by: str, temperature: float) -> None:
    base = torch.tensor([1.2, 0.3, -0.4, 0.9, -1.1, 0.0, 0.5, -0.2])
    logits = base.to(device).unsqueeze(0).expand(DRAWS, -1)
    rows = same_params_rows(SamplingParams(temperature=temperature), DRAWS, seed=123, by=by)
    counts = _counts(run_sampler(logits, rows).token_ids, 8)
    statistic = chi_square(counts, torch.softmax(base / temperature, dim=0))
    assert statistic < chi_square_critical(7)


def test_draws_match_the_renormalised_filtered_distribution(device: str) -> None:
    probs = [0.3, 0.25, 0.2, 0.15, 0.06, 0.04]
    # top-k 4 leaves [.3, .25, .2, .15] / .9; top-p .7 over that keeps three (mass before the
    # fourth is .75/.9 = .83); min-p .5 would cut below .15, so all three stay: [.3, .25, .2] / .75.
    params = SamplingParams(top_k=4, top_p=0.7, min_p=0.5)
    logits = logits_from_probs(probs, device).expand(DRAWS, -1)
    counts = _counts(run_sampler(logits, same_params_rows(params, DRAWS, seed=77)).token_ids, 6)
    assert counts[3:].sum() == 0
    statistic = chi_square(counts[:3], torch.tensor([0.3, 0.25, 0.2]) / 0.75)
    assert statistic < chi_square_critical(2)


def test_a_wrong_distribution_is_rejected_by_the_same_bound(device: str) -> None:
    """The bound has power: the draws above would fail against a slightly different softmax."""
    base = torch.tensor([1.2, 0.3, -0.4, 0.9, -1.1, 0.0, 0.5, -0.2])
    logits = base.to(device).unsqueeze(0).expand(DRAWS, -1)
    counts = _counts(run_sampler(logits, same_params_rows(SamplingParams(), DRAWS, seed=123)).token_ids, 8)
    assert chi_square(counts, torch.softmax(base / 1.1, dim=0)) > chi_square_critical(7)


def test_uniform_noise_is_uniform_and_uncorrelated(device: str) -> None:
    rows, vocab = 64, 4096
    seed = torch.arange(rows, device=device, dtype=torch.int64) * 1_000_003
    step = torch.arange(rows, device=device, dtype=torch.int64) % 5
    uniform = uniform_noise(seed, step, vocab).double().cpu()
    assert float(uniform.min()) > 0.0 and float(uniform.max()) < 1.0

    bins = 64
    counts = torch.bincount((uniform * bins).long().flatten(), minlength=bins)
    assert chi_square(counts, torch.full((bins,), 1 / bins)) < chi_square_critical(bins - 1)

    def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()))

    # Neighbouring token ids, neighbouring rows, and the same seed one step later.
    assert abs(correlation(uniform[:, 1:], uniform[:, :-1])) < 0.01
    assert abs(correlation(uniform[1:], uniform[:-1])) < 0.01
    next_step = uniform_noise(seed, step + 1, vocab).double().cpu()
    assert abs(correlation(uniform, next_step)) < 0.01


def test_gumbel_noise_has_gumbel_moments(device: str) -> None:
    seed = torch.arange(16, device=device, dtype=torch.int64)
    noise = gumbel_noise(seed, torch.zeros_like(seed), 8192).double()
    euler_gamma = 0.5772156649
    assert torch.isfinite(noise).all()
    assert abs(float(noise.mean()) - euler_gamma) < 0.01
    assert abs(float(noise.var()) - math.pi**2 / 6) < 0.03


def test_mix_words_is_a_bijection_on_a_sample(device: str) -> None:
    words = torch.arange(0, 2**32, 2**32 // 65536, device=device, dtype=torch.int64)
    mixed = mix_words(words)
    assert int(mixed.min()) >= 0 and int(mixed.max()) < 2**32
    assert mixed.unique().numel() == words.numel()
    # Avalanche: flipping the lowest input bit flips about half of the 32 output bits.
    flipped = mix_words(words ^ 1)
    changed_bits = torch.stack([((mixed ^ flipped) >> bit) & 1 for bit in range(32)]).sum(0).double()
    assert abs(float(changed_bits.mean()) - 16.0) < 0.5
