"""One step's sampling parameters: packed on the host, copied to the device in two transfers.

A step samples one token for each of `rows` logit rows. The host packs every row's parameters
into one float32 [3, rows] tensor (temperature, top_p, min_p) and one int64 [4, rows] tensor
(top_k, greedy flag, seed, step index), so the copy to the device is two transfers whatever the
batch.

Seeds. A request's seed is taken modulo 2**64. A request without a seed gets one drawn per
request on the host (`SeedSource`): a keyed hash of its request id under a per-process random
key, so it stays the same across the request's steps (and across a preemption's recompute)
without any bookkeeping to free, yet differs between requests and between processes.

Step index: the number of tokens the request has already generated; with the seed it keys the
noise, so token n of a seeded request is drawn from the same noise in any batch.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.contract import SamplingParams
from engine.forward_batch import HostStaging
from engine.runner import BatchRow

# Temperatures below this sample greedily, as vLLM does: dividing logits by a tinier number
# overflows float32 and the distribution is a point mass at the argmax anyway.
GREEDY_TEMPERATURE = 1e-5

_SEED_MODULUS = 2**64


def _as_int64_seed(seed: int) -> int:
    """The seed modulo 2**64, as the signed int64 with the same bits."""
    wrapped = seed % _SEED_MODULUS
    return wrapped - _SEED_MODULUS if wrapped >= 2**63 else wrapped


@dataclass(slots=True, frozen=True)
class SeedSource:
    """Resolves each request's seed: its own, or one derived from its id under a random key."""

    key: bytes = field(default_factory=lambda: secrets.token_bytes(16), repr=False)

    def seed_for(self, request_id: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        digest = hashlib.blake2b(request_id.encode(), key=self.key, digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)


@dataclass(slots=True, frozen=True)
class RowSampling:
    """One logit row's sampling inputs: its parameters, its resolved seed, its step index."""

    params: SamplingParams
    seed: int
    step: int

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step={self.step!r}: the number of generated tokens cannot be negative")

    @classmethod
    def of(cls, row: BatchRow, seeds: SeedSource) -> RowSampling:
        # A greedy row draws no noise, so its seed is never read: skip hashing its id every step.
        greedy = row.sampling.temperature < GREEDY_TEMPERATURE
        seed = 0 if greedy else seeds.seed_for(row.request_id, row.sampling)
        return cls(row.sampling, seed, row.num_generated)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_TEMPERATURE


@dataclass(slots=True, frozen=True)
class SamplingPlan:
    """The static choices one sampler call is traced with (Python values, never tensors).

    `num_logprobs`: None computes no log-probs; k computes the chosen token's and the top k.
    `sorted_filters`: run the top-k/top-p pass (a full sort per row). Rows with both filters off
    give bit-identical results either way, so eager steps skip the sort when no row needs it.
    `random_rows`: run the noise and filter path; when off every row is sampled greedily.
    `min_p_filter`: run min-p (and the row-maximum pass it needs); rows with min-p off give
    bit-identical results either way.
    `widest` serves every step (start-up profiles the sampler with it).
    """

    num_logprobs: int | None = None
    sorted_filters: bool = True
    random_rows: bool = True
    min_p_filter: bool = True

    def __post_init__(self) -> None:
        if self.num_logprobs is not None and self.num_logprobs < 0:
            raise ValueError(f"num_logprobs={self.num_logprobs!r}: must be None or >= 0")

    @classmethod
    def widest(cls, num_logprobs: int | None) -> SamplingPlan:
        return cls(num_logprobs=num_logprobs, sorted_filters=True, random_rows=True, min_p_filter=True)


@dataclass(slots=True, frozen=True)
class SamplingTensors:
    """Per-row parameters on the sampler's device, each [rows]. Views into two packed tensors:
    float32 temperature (1.0 on greedy rows), top_p (1.0 = off), min_p (0.0 = off); int64 top_k
    (0 = off), greedy (1 = take the argmax), seed (64-bit), step (tokens generated so far)."""

    temperature: Tensor
    top_p: Tensor
    min_p: Tensor
    top_k: Tensor
    greedy: Tensor
    seed: Tensor
    step: Tensor

    @classmethod
    def from_packed(cls, floats: Tensor, ints: Tensor, num_rows: int) -> SamplingTensors:
        return cls(
            temperature=floats[0, :num_rows],
            top_p=floats[1, :num_rows],
            min_p=floats[2, :num_rows],
            top_k=ints[0, :num_rows],
            greedy=ints[1, :num_rows],
            seed=ints[2, :num_rows],
            step=ints[3, :num_rows],
        )

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])


@dataclass(slots=True, frozen=True)
class SamplingBatch:
    """One step's packed parameters on the host, plus what the host needs afterwards."""

    floats: Tensor
    ints: Tensor
    # Per row, the number of top alternatives its request asked for (None: no log-probs).
    logprobs_requested: tuple[int | None, ...]
    # The cheapest plan that serves this step.
    plan: SamplingPlan

    @classmethod
    def pack(cls, rows: Sequence[RowSampling]) -> SamplingBatch:
        if not rows:
            raise ValueError("rows=[]: a sampling batch needs at least one row")
        # One pass over the rows; columns are filled in the packed tensors' row order.
        temperature: list[float] = []
        top_p: list[float] = []
        min_p: list[float] = []
        top_k: list[int] = []
        greedy: list[int] = []
        seed: list[int] = []
        step: list[int] = []
        requested: list[int | None] = []
        sorted_filters = random_rows = min_p_filter = False
        for row in rows:
            params = row.params
            is_greedy = params.temperature < GREEDY_TEMPERATURE
            temperature.append(1.0 if is_greedy else params.temperature)
            top_p.append(params.top_p)
            min_p.append(params.min_p)
            top_k.append(params.top_k)
            greedy.append(int(is_greedy))
            seed.append(_as_int64_seed(row.seed))
            step.append(row.step)
            requested.append(params.logprobs)
            if not is_greedy:
                random_rows = True
                sorted_filters = sorted_filters or params.top_k > 0 or params.top_p < 1.0
                min_p_filter = min_p_filter or params.min_p > 0.0
        floats = torch.tensor([temperature, top_p, min_p], dtype=torch.float32)
        ints = torch.tensor([top_k, greedy, seed, step], dtype=torch.int64)
        plan = SamplingPlan(
            num_logprobs=max((k for k in requested if k is not None), default=None),
            sorted_filters=sorted_filters,
            random_rows=random_rows,
            min_p_filter=min_p_filter,
        )
        return cls(floats=floats, ints=ints, logprobs_requested=tuple(requested), plan=plan)

    @property
    def num_rows(self) -> int:
        return len(self.logprobs_requested)

    def to(self, device: torch.device | str, staging: HostStaging | None = None) -> SamplingTensors:
        """The packed parameters on `device`, through `staging`'s pinned buffers when given."""
        floats, ints = self.floats, self.ints
        if staging is not None:
            floats, ints = staging.stage("sampling_floats", floats), staging.stage("sampling_ints", ints)
        floats = floats.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        return SamplingTensors.from_packed(floats, ints, self.num_rows)
