"""Helpers for the sampler tests: batch builders and a chi-square bound."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.contract import SamplingParams
from engine.sampling import SamplerOutput, sample
from engine.sampling_batch import RowSampling, SamplingBatch


def run_sampler(logits: torch.Tensor, rows: Sequence[RowSampling]) -> SamplerOutput:
    """Pack `rows`, move them to the logits' device, sample with the batch's own plan."""
    batch = SamplingBatch.pack(rows)
    return sample(logits, batch.to(logits.device), batch.plan)


def same_params_rows(
    params: SamplingParams, count: int, *, seed: int = 0, by: str = "step"
) -> list[RowSampling]:
    """`count` rows with one set of parameters and distinct noise: steps 0.. (by="step") under one
    seed, or seeds seed.. at step 0 (by="seed")."""
    if by == "step":
        return [RowSampling(params, seed, step) for step in range(count)]
    return [RowSampling(params, seed + i, 0) for i in range(count)]


def logits_from_probs(probs: Sequence[float], device: str = "cpu") -> torch.Tensor:
    """A one-row logit vector whose softmax is `probs` (up to float rounding)."""
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32, device=device)


def chi_square_critical(degrees_of_freedom: int, z: float = 3.09) -> float:
    """Upper critical value of chi-square (Wilson-Hilferty); z=3.09 is a one-sided 0.1 % level."""
    k = degrees_of_freedom
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs.double() * counts.sum().double()
    return float(((counts.double() - expected) ** 2 / expected).sum())
