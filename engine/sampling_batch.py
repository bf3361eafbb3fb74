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

import numpy as np
import torch
from torch import Tensor

from engine.contract import SamplingParams
from engine.forward_batch import HostStaging
from engine.runner import BatchRow

# Temperatures below this sample greedily, as vLLM does: dividing logits by a tinier number
# overflows float32 and the distribution is a point mass at the argmax anyway.
GREEDY_TEMPERATURE = 1e-5

_SEED_MODULUS = 2**64


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
        return cls(row.sampling, _row_seed(row, seeds), row.num_generated)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_TEMPERATURE


def _row_seed(row: BatchRow, seeds: SeedSource) -> int:
    """The seed a row samples with. A greedy row draws no noise, so its seed is never read: its id
    is not hashed every step."""
    if row.sampling.temperature < GREEDY_TEMPERATURE:
        return 0
    return seeds.seed_for(row.request_id, row.sampling)


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
    def from_packed(cls, floats: Tensor, ints: Tensor) -> SamplingTensors:
        """The views of `SamplingBatch`'s two packed tensors (float32 [3, rows], int64 [4, rows])."""
        temperature, top_p, min_p = floats.unbind(0)
        top_k, greedy, seed, step = ints.unbind(0)
        return cls(temperature, top_p, min_p, top_k, greedy, seed, step)

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
        params = [r.params for r in rows]
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        return cls._from_columns(params, greedy, [r.seed for r in rows], [r.step for r in rows])

    @classmethod
    def of_step(
        cls, rows: Sequence[BatchRow], seeds: SeedSource, columns: SamplingColumnsCache | None = None
    ) -> SamplingBatch:
        """The step's rows that sample, in order: `pack` of each one's `RowSampling.of`, built in
        column passes without an object per row (once per step on the host's critical path).
        `columns`: the last step packed through it is reused when this one samples the same
        requests with the same parameters, in the same order (only the step column is new)."""
        sampling = [r for r in rows if r.sample]
        if not sampling:
            raise ValueError("rows: no row samples, and a sampling batch needs at least one row")
        params = [r.sampling for r in sampling]
        steps = [r.num_generated for r in sampling]
        if min(steps) < 0:
            raise ValueError(f"step={min(steps)!r}: the number of generated tokens cannot be negative")
        request_ids = [r.request_id for r in sampling]
        if columns is not None:
            reused = columns.reuse(request_ids, params, seeds, steps)
            if reused is not None:
                return reused
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        # `_row_seed` of each row: a greedy row's seed is never read, so only random rows hash.
        row_seeds = [
            0 if g else seeds.seed_for(rid, p) for rid, p, g in zip(request_ids, params, greedy, strict=True)
        ]
        batch = cls._from_columns(params, greedy, row_seeds, steps)
        if columns is not None:
            columns.keep(request_ids, params, seeds, batch)
        return batch

    @classmethod
    def _from_columns(
        cls,
        params: Sequence[SamplingParams],
        greedy: Sequence[bool],
        seeds: Sequence[int],
        steps: Sequence[int],
    ) -> SamplingBatch:
        """Row i samples with params[i] (greedy[i]: its temperature is below `GREEDY_TEMPERATURE`),
        seed seeds[i], step steps[i]. Each packed row is built by one pass over a column: the
        batch's cost is a few list comprehensions."""
        # Through numpy: a third of `torch.tensor`'s cost for nested lists.
        floats = np.array(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                [p.top_p for p in params],
                [p.min_p for p in params],
            ],
            dtype=np.float32,
        )
        ints = np.empty((4, len(params)), dtype=np.int64)
        ints[0] = [p.top_k for p in params]
        ints[1] = greedy
        # Each seed modulo 2**64, as the signed int64 with the same bits (numpy's view of uint64).
        ints[2] = np.array([s % _SEED_MODULUS for s in seeds], dtype=np.uint64).view(np.int64)
        ints[3] = steps
        requested = tuple([p.logprobs for p in params])
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        plan = SamplingPlan(
            num_logprobs=max([k for k in requested if k is not None], default=None),
            sorted_filters=any(p.top_k > 0 or p.top_p < 1.0 for p in random_params),
            random_rows=bool(random_params),
            min_p_filter=any(p.min_p > 0.0 for p in random_params),
        )
        return cls(
            floats=torch.from_numpy(floats),
            ints=torch.from_numpy(ints),
            logprobs_requested=requested,
            plan=plan,
        )

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
        return SamplingTensors.from_packed(floats, ints)


class SamplingColumnsCache:
    """The last step's packed sampling columns, kept with what they are a function of.

    Every column but the step index depends only on each sampling row's request: its parameters,
    and its seed (its own, or drawn from its id under `SeedSource`'s key). So a step whose sampling
    rows are the same request ids with equal parameters, in the same order, under the same
    `SeedSource` (a decode step's common case: the last step's rows again) copies the kept arrays
    and writes only the step column, instead of a dozen passes over the rows (0.3–0.45 µs a row,
    docs/benchmarks/host-cpu.md). The result is always `SamplingBatch.of_step` without the cache.
    The cache holds its own copies and every call returns new tensors, so no batch handed out
    shares memory with another."""

    def __init__(self) -> None:
        self._request_ids: list[str] = []
        self._params: list[SamplingParams] = []
        self._seeds: SeedSource | None = None
        # The kept batch's columns (step column included, overwritten on reuse), its log-prob
        # requests and plan; None until a batch is kept.
        self._floats: np.ndarray | None = None
        self._ints: np.ndarray | None = None
        self._requested: tuple[int | None, ...] = ()
        self._plan = SamplingPlan()

    def reuse(
        self, request_ids: list[str], params: list[SamplingParams], seeds: SeedSource, steps: list[int]
    ) -> SamplingBatch | None:
        """The kept batch with `steps` as its step column, or None when its rows differ."""
        if (
            self._floats is None
            or self._ints is None
            or seeds is not self._seeds
            # Element by element: the same objects at once (a request keeps its id and parameters
            # from step to step), equal parameters through their `==`.
            or request_ids != self._request_ids
            or params != self._params
        ):
            return None
        ints = self._ints.copy()
        ints[3] = steps
        return SamplingBatch(
            floats=torch.from_numpy(self._floats.copy()),
            ints=torch.from_numpy(ints),
            logprobs_requested=self._requested,
            plan=self._plan,
        )

    def keep(
        self, request_ids: list[str], params: list[SamplingParams], seeds: SeedSource, batch: SamplingBatch
    ) -> None:
        self._request_ids, self._params, self._seeds = request_ids, params, seeds
        self._floats, self._ints = batch.floats.numpy().copy(), batch.ints.numpy().copy()
        self._requested, self._plan = batch.logprobs_requested, batch.plan
