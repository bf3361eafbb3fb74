"""One step's sampling parameters: packed on the host, copied to the device in two transfers.

A step samples one token for each of `rows` logit rows. The host packs every row's parameters
into one float32 [3, rows] tensor (temperature, top_p, min_p) and one int64 [4, rows] tensor
(top_k, greedy flag, seed, step index), so the copy to the device is two transfers whatever the
batch. `SamplingBuffers` preallocates both at a maximum row count for CUDA graphs: a step copies
into them and the captured sampler reads views whose addresses never change.

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
from engine.runner import BatchRow

# Temperatures below this sample greedily, as vLLM does: dividing logits by a tinier number
# overflows float32 and the distribution is a point mass at the argmax anyway.
GREEDY_TEMPERATURE = 1e-5

_SEED_MODULUS = 2**64

# What a padding row (a CUDA-graph bucket's filler) samples with: greedy, no filters. Layout as
# `SamplingTensors.from_packed` reads it: (temperature, top_p, min_p), (top_k, greedy, seed, step).
_PADDING_FLOATS = (1.0, 1.0, 0.0)
_PADDING_INTS = (0, 1, 0, 0)


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
        return cls(row.sampling, seeds.seed_for(row.request_id, row.sampling), row.num_generated)

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
    A CUDA graph must be captured with the plan of its most demanding step: `for_graph`.
    """

    num_logprobs: int | None = None
    sorted_filters: bool = True
    random_rows: bool = True

    def __post_init__(self) -> None:
        if self.num_logprobs is not None and self.num_logprobs < 0:
            raise ValueError(f"num_logprobs={self.num_logprobs!r}: must be None or >= 0")

    @classmethod
    def for_graph(cls, num_logprobs: int | None) -> SamplingPlan:
        return cls(num_logprobs=num_logprobs, sorted_filters=True, random_rows=True)

    def covers(self, other: SamplingPlan) -> bool:
        """Whether a sampler traced with this plan serves a step that needs `other`."""
        logprobs_ok = other.num_logprobs is None or (
            self.num_logprobs is not None and self.num_logprobs >= other.num_logprobs
        )
        return (
            logprobs_ok
            and (self.sorted_filters or not other.sorted_filters)
            and (self.random_rows or not other.random_rows)
        )


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


class SamplingBuffers:
    """Device buffers for up to `max_rows` rows, allocated once so CUDA graphs can read them."""

    __slots__ = ("floats", "ints", "max_rows")

    def __init__(self, max_rows: int, device: torch.device | str) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows!r}: must be at least 1")
        self.max_rows = max_rows
        self.floats = torch.tensor(_PADDING_FLOATS, dtype=torch.float32, device=device)
        self.floats = self.floats.unsqueeze(1).repeat(1, max_rows).contiguous()
        self.ints = torch.tensor(_PADDING_INTS, dtype=torch.int64, device=device)
        self.ints = self.ints.unsqueeze(1).repeat(1, max_rows).contiguous()

    def view(self, num_rows: int) -> SamplingTensors:
        """The first `num_rows` rows, e.g. a graph bucket; same storage on every call."""
        if not 1 <= num_rows <= self.max_rows:
            raise ValueError(f"num_rows={num_rows!r}: must be in [1, {self.max_rows}]")
        return SamplingTensors.from_packed(self.floats, self.ints, num_rows)


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
    def pack(cls, rows: Sequence[RowSampling], *, pin_memory: bool = False) -> SamplingBatch:
        if not rows:
            raise ValueError("rows=[]: a sampling batch needs at least one row")
        floats = torch.tensor(
            [
                [1.0 if row.greedy else row.params.temperature for row in rows],
                [row.params.top_p for row in rows],
                [row.params.min_p for row in rows],
            ],
            dtype=torch.float32,
        )
        ints = torch.tensor(
            [
                [row.params.top_k for row in rows],
                [int(row.greedy) for row in rows],
                [_as_int64_seed(row.seed) for row in rows],
                [row.step for row in rows],
            ],
            dtype=torch.int64,
        )
        if pin_memory:
            floats, ints = floats.pin_memory(), ints.pin_memory()
        requested = tuple(row.params.logprobs for row in rows)
        random_rows = [row for row in rows if not row.greedy]
        plan = SamplingPlan(
            num_logprobs=max((k for k in requested if k is not None), default=None),
            sorted_filters=any(row.params.top_k > 0 or row.params.top_p < 1.0 for row in random_rows),
            random_rows=bool(random_rows),
        )
        return cls(floats=floats, ints=ints, logprobs_requested=requested, plan=plan)

    @property
    def num_rows(self) -> int:
        return len(self.logprobs_requested)

    def to(self, device: torch.device | str) -> SamplingTensors:
        """Eager use: copy to `device` (non-blocking when packed into pinned memory)."""
        floats = self.floats.to(device, non_blocking=True)
        ints = self.ints.to(device, non_blocking=True)
        return SamplingTensors.from_packed(floats, ints, self.num_rows)

    def copy_into(self, buffers: SamplingBuffers, padded_rows: int | None = None) -> SamplingTensors:
        """Graph use: write this batch into `buffers`, rows [num_rows, padded_rows) as greedy
        padding, and return the view of `padded_rows` rows (the bucket a graph was captured at)."""
        rows = self.num_rows if padded_rows is None else padded_rows
        if not self.num_rows <= rows <= buffers.max_rows:
            raise ValueError(f"padded_rows={padded_rows!r}: must be in [{self.num_rows}, {buffers.max_rows}]")
        floats, ints = self.floats, self.ints
        if rows > self.num_rows:
            filler = rows - self.num_rows
            float_pad = torch.tensor(_PADDING_FLOATS, dtype=torch.float32).unsqueeze(1).expand(-1, filler)
            int_pad = torch.tensor(_PADDING_INTS, dtype=torch.int64).unsqueeze(1).expand(-1, filler)
            floats, ints = torch.cat([floats, float_pad], dim=1), torch.cat([ints, int_pad], dim=1)
        buffers.floats[:, :rows].copy_(floats, non_blocking=True)
        buffers.ints[:, :rows].copy_(ints, non_blocking=True)
        return buffers.view(rows)
