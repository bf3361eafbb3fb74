"""Decode and prefill latency of a served model against the device's measured limits.

Decode: B requests with C-token contexts decode together; a step is timed end to end on the host
(scheduler, graph replay, sampling, tokens back), and the captured graph's replay alone with CUDA
events. Floor: (weights + the batch's KV) / measured copy bandwidth, and beside it the same bytes over
the measured read-only stream rate (a GEMV streams ~5 % faster per byte than a copy moves them).
Under async scheduling a step
launches the next forward and returns the previous one's tokens, so the steps are timed back to back
with no synchronisation between them: each one's time is the steady-state interval between two
tokens of every row, host work included wherever it did not overlap the device.
Prefill: one request of L tokens prefilled in one step. Floor: flops / measured bf16 matmul rate.
Every ceiling is measured in the same run, never taken from a data sheet. Each result also counts
the caching allocator's device allocations, frees and retries during its timed steps: any at all
means a step paid for `cudaMalloc`/`cudaFree` (which synchronise) rather than for its kernels.
One run may cover several numeric policies (`PolicyRun`, one model load each); every result row in
the JSON carries the policy it ran under.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from engine.contract import Request, SamplingParams
from engine.forward_batch import RooflineFacts
from engine.model_runner import PagedModelRunner
from engine.scheduler import BatchScheduler
from infer_cli.bench.step_profile import StepBreakdown, profile_steps
from infer_cli.bench.timing import copy_gb_per_s, device_ms, matmul_tflops, stream_gb_per_s

# Steps profiled for a breakdown (`breakdown=True`), after the timed ones.
PROFILED_STEPS = 3

log = logging.getLogger(__name__)


def _breakdown(scheduler: BatchScheduler, host_ms: float, steps: int) -> StepBreakdown | None:
    """The profiled breakdown, or None, said in the log, when the profiler itself fails (no CUPTI,
    say): the timings it would annotate are measured without it and are kept."""
    try:
        return profile_steps(scheduler.step, _device(), host_ms, steps)
    except RuntimeError as exc:
        log.warning("step breakdown unavailable, timings kept: %s", exc)
        return None


@dataclass(frozen=True, slots=True)
class AllocatorCounts:
    """What the CUDA caching allocator did during timed steps (`torch.cuda.memory_stats` deltas)."""

    device_allocs: int
    device_frees: int
    retries: int

    @property
    def quiet(self) -> bool:
        return not (self.device_allocs or self.device_frees or self.retries)


_ALLOCATOR_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def _allocator_stats() -> tuple[int, ...] | None:
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    return tuple(int(stats.get(key, 0)) for key in _ALLOCATOR_KEYS)


def _allocator_since(before: tuple[int, ...] | None) -> AllocatorCounts | None:
    after = _allocator_stats()
    if before is None or after is None:
        return None
    allocs, frees, retries = (a - b for a, b in zip(after, before, strict=True))
    return AllocatorCounts(allocs, frees, retries)


@dataclass(frozen=True, slots=True)
class DecodeResult:
    batch: int
    context: int
    step_ms: float
    replay_ms: float | None
    floor_ms: float
    stream_floor_ms: float
    breakdown: StepBreakdown | None = None
    allocator: AllocatorCounts | None = None

    @property
    def step_pct_of_floor(self) -> float:
        return 100.0 * self.floor_ms / self.step_ms

    @property
    def step_pct_of_stream_floor(self) -> float:
        return 100.0 * self.stream_floor_ms / self.step_ms

    @property
    def tokens_per_s(self) -> float:
        return self.batch / (self.step_ms * 1e-3)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    tokens: int
    ms: float  # the median run
    floor_ms: float
    breakdown: StepBreakdown | None = None
    allocator: AllocatorCounts | None = None
    # The fastest and slowest runs: a host-bound prefill's runs spread with the host's noise.
    min_ms: float | None = None
    max_ms: float | None = None

    @property
    def pct_of_floor(self) -> float:
        return 100.0 * self.floor_ms / self.ms

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.ms * 1e-3)


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_gb_per_s: float
    matmul_tflops: float
    stream_gb_per_s: float


def measure_ceilings(device: torch.device) -> Ceilings:
    return Ceilings(
        copy_gb_per_s=copy_gb_per_s(device),
        matmul_tflops=matmul_tflops(device),
        stream_gb_per_s=stream_gb_per_s(device),
    )


def decode_floor_ms(
    facts: RooflineFacts, batch: int, context: int, ceilings: Ceilings, *, stream: bool = False
) -> float:
    """The decode step's bytes over the copy bandwidth, or (`stream`) the read-only stream rate."""
    per_row = context * facts.kv_bytes_per_token + 2 * facts.state_bytes_per_row  # state: read, written
    moved = facts.weight_bytes + batch * per_row
    rate = ceilings.stream_gb_per_s if stream else ceilings.copy_gb_per_s
    return moved / (rate * 1e9) * 1e3


def prefill_floor_ms(facts: RooflineFacts, tokens: int, ceilings: Ceilings) -> float:
    causal_pairs = tokens * (tokens + 1) // 2
    flops = 2 * facts.matmul_params * tokens + facts.attention_flops_per_pair * causal_pairs
    return flops / (ceilings.matmul_tflops * 1e12) * 1e3


# Prompt ids are drawn below this, which every supported vocabulary exceeds; their values do not
# change the work a forward does.
PROMPT_ID_LIMIT = 1000


def _prompt(length: int, salt: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(salt)
    return tuple(torch.randint(10, PROMPT_ID_LIMIT, (length,), generator=generator).tolist())


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _idle(scheduler: BatchScheduler) -> None:
    while scheduler.has_work():
        scheduler.step()


def bench_decode(
    scheduler: BatchScheduler,
    facts: RooflineFacts,
    ceilings: Ceilings,
    batch: int,
    context: int,
    iters: int = 30,
    breakdown: bool = False,
    temperature: float = 0.0,
) -> DecodeResult:
    """`temperature` 0 decodes greedily; above it every row samples (vLLM's `bench latency` samples
    at 1.0), so the step includes the sampled path's draw."""
    warmup = 5
    # Each request must outlive the timed and profiled steps plus every step it decodes while the
    # others still prefill: chunked under a small token budget, that is many steps. A step
    # prefills at least (budget - batch) tokens beside the decodes, so twice that count is room
    # enough; the requests still running after the measurement are aborted.
    budget = scheduler.config.max_num_batched_tokens
    prefill_room = 2 * (math.ceil(batch * context / max(1, budget - batch)) + batch)
    params = SamplingParams(
        max_tokens=warmup + iters + PROFILED_STEPS + 2 + prefill_room,
        temperature=temperature,
        ignore_eos=True,
    )
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        scheduler.submit(Request(rid, _prompt(context, 1000 * batch + i), params))
    # Prefill everything, then step until every request is decoding.
    prefill_steps = 0
    while scheduler.load().waiting or _prefilling(scheduler):
        scheduler.step()
        prefill_steps += 1
    if prefill_steps > prefill_room:
        raise RuntimeError(
            f"batch {batch} took {prefill_steps} steps to prefill under a {budget}-token budget; "
            f"its requests had room for {prefill_room}"
        )
    for _ in range(warmup):
        scheduler.step()
    pipelined = scheduler.async_stats.launches > 0
    times = []
    _sync()
    allocator = _allocator_stats()
    for _ in range(iters):
        if not pipelined:
            # A synchronous step ends on its token readback already; this only keeps it honest.
            _sync()
        start = time.perf_counter()
        outputs = scheduler.step()
        times.append((time.perf_counter() - start) * 1e3)
        if len(outputs.updates) != batch:
            raise RuntimeError(
                f"a timed decode step returned {len(outputs.updates)} updates for {batch} rows"
            )
    step_ms = statistics.median(times)
    allocated = _allocator_since(allocator)
    profile = _breakdown(scheduler, step_ms, PROFILED_STEPS) if breakdown else None
    replay = _replay_ms(scheduler.runner, batch)
    for rid in ids:
        scheduler.abort(rid)
    _idle(scheduler)
    return DecodeResult(
        batch,
        context,
        step_ms,
        replay,
        decode_floor_ms(facts, batch, context, ceilings),
        decode_floor_ms(facts, batch, context, ceilings, stream=True),
        profile,
        allocated,
    )


def _prefilling(scheduler: BatchScheduler) -> bool:
    return scheduler.prefilling_count() > 0


def _replay_ms(runner: object, batch: int) -> float | None:
    """The replay of the bucket graph serving `batch` rows alone (its buffers hold the last step)."""
    if not isinstance(runner, PagedModelRunner) or runner.graphs is None:
        return None
    graph = runner.graphs.graph_for(batch)
    if graph is None:
        return None
    return device_ms(graph.replay)


def bench_prefill(
    scheduler: BatchScheduler,
    facts: RooflineFacts,
    ceilings: Ceilings,
    tokens: int,
    iters: int = 5,
    breakdown: bool = False,
) -> PrefillResult:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def submit(i: int) -> str:
        # A fresh prompt each time: a prefix-cache hit would skip the work being measured.
        rid = f"prefill-{tokens}-{i}"
        scheduler.submit(Request(rid, _prompt(tokens, 7_000_000 + 31 * tokens + i), params))
        return rid

    times = []
    allocator: tuple[int, ...] | None = None
    for i in range(iters + 1):
        if i == 1:
            allocator = _allocator_stats()
        rid = submit(i)
        _sync()
        start = time.perf_counter()
        # Until the step that returns its token: the one that ran it, or under async scheduling
        # the next, which collects it.
        while not any(u.request_id == rid and u.new_token_ids for u in scheduler.step().updates):
            pass
        elapsed = (time.perf_counter() - start) * 1e3
        _idle(scheduler)
        if i:  # the first run warms kernels for this shape
            times.append(elapsed)
    ms = statistics.median(times)
    allocated = _allocator_since(allocator)
    profile = None
    if breakdown:
        submit(iters + 1)
        profile = _breakdown(scheduler, ms, steps=1)
        _idle(scheduler)
    floor = prefill_floor_ms(facts, tokens, ceilings)
    return PrefillResult(tokens, ms, floor, profile, allocated, min(times), max(times))


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """Every decode and prefill measurement of one model load under one numeric policy."""

    policy: str
    decode: tuple[DecodeResult, ...]
    prefill: tuple[PrefillResult, ...]


def _row(result: DecodeResult | PrefillResult) -> dict[str, object]:
    row = asdict(result)
    if result.breakdown is not None:
        row["breakdown"] = asdict(result.breakdown) | {"host_gap_ms": result.breakdown.host_gap_ms}
    return row


def results_json(runs: Sequence[PolicyRun], ceilings: Ceilings, facts: RooflineFacts) -> dict[str, object]:
    return {
        "ceilings": asdict(ceilings),
        "roofline_facts": asdict(facts),
        "numeric_policies": [run.policy for run in runs],
        "decode": [
            {"policy": run.policy}
            | _row(d)
            | {
                "pct_of_floor": d.step_pct_of_floor,
                "pct_of_stream_floor": d.step_pct_of_stream_floor,
                "tokens_per_s": d.tokens_per_s,
            }
            for run in runs
            for d in run.decode
        ],
        "prefill": [
            {"policy": run.policy}
            | _row(p)
            | {"pct_of_floor": p.pct_of_floor, "tokens_per_s": p.tokens_per_s}
            for run in runs
            for p in run.prefill
        ],
    }
