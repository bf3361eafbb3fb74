"""The graph-memory gate every model suite runs: start-up at utilisation 0.9 with every decode bucket
up to 256 captured and the KV pool sized from the measured budget (no fixed page count) leaves the
configured margin free, and the graph memory it reserved is within 10 % of what the graphs took.

Margin: `(1 − utilisation) × total` device memory is what the engine promised not to take. It is
checked right after start-up and again after the largest steps the configuration allows have run
(every bucket-256 row decoding, then the token budget as one prefill), when the activation peak the
budget reserved is in use again. No slack is subtracted: memory the budget does not count (the CUDA
context, library workspaces outside torch's allocator) is exactly what this gate is there to catch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.contract import Request
from engine.cuda_graphs import MAX_GRAPH_BUCKET, CaptureRecord, decode_buckets
from engine.graph_budget import ReserveCheck
from engine.memory_budget import GIB
from gates.harness.serving import drive, greedy, load_for_gate, paged_runner, random_prompt

MIB = 1 << 20

UTILISATION = 0.9
# serve's default step budget: the profiled activation peak is the one serve would reserve.
SERVE_TOKEN_BUDGET = EngineConfig().max_num_batched_tokens
RESERVE_TOLERANCE_PCT = 10.0
# `tuned` is what serve runs by default; `invariant` is the policy whose graphs the issue sizes.
# `per-token` graphs at bucket 256 may not fit a 12B model at all (start-up then refuses by name).
MEMORY_POLICIES = ("tuned", "invariant")


class GraphMemoryError(AssertionError):
    """Free memory under the margin, or a reserved graph figure too far from the measured one."""


@dataclass(frozen=True, slots=True)
class MarginReading:
    when: str
    free: int
    total: int
    utilisation: float
    # torch's allocator at the reading: live tensors, and what it holds (live + cached blocks).
    allocated: int
    reserved: int

    @property
    def margin(self) -> int:
        return int((1.0 - self.utilisation) * self.total)

    @property
    def holds(self) -> bool:
        return self.free >= self.margin

    def describe(self) -> str:
        # Where the memory is, so a broken margin says whether the allocator's cache (fragmentation
        # across step shapes) or memory outside it grew.
        outside = self.total - self.free - self.reserved
        return (
            f"{self.when}: free {self.free / GIB:.3f} GiB, margin {self.margin / GIB:.3f} GiB "
            f"((1 − {self.utilisation}) × {self.total / GIB:.1f} GiB); torch allocated "
            f"{self.allocated / GIB:.3f} GiB, cached {(self.reserved - self.allocated) / GIB:.3f} GiB, "
            f"outside torch {outside / GIB:.3f} GiB"
        )


def read_margin(when: str, utilisation: float) -> MarginReading:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return MarginReading(
        when, free, total, utilisation, torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    )


def _bucket_differences(reserved: Sequence[CaptureRecord], measured: Sequence[CaptureRecord]) -> str:
    """The buckets whose trial and real captures differ most (free-memory drop, and pool growth)."""
    trial = {r.bucket: r for r in reserved}
    pairs = sorted(
        ((trial[r.bucket], r) for r in measured if r.bucket in trial),
        key=lambda p: -abs(p[0].bytes_added - p[1].bytes_added),
    )
    return "; ".join(
        f"bucket {t.bucket}: trial {t.bytes_added / MIB:.0f} MiB (pool {t.pool_bytes / MIB:.0f}), "
        f"real {m.bytes_added / MIB:.0f} MiB (pool {m.pool_bytes / MIB:.0f})"
        for t, m in pairs[:3]
    )


def _largest_steps(
    vocab_size: int, rows: int, budget: int, avoid: Sequence[int]
) -> tuple[list[Request], list[Request]]:
    """`rows` requests at once (short prompts, a few decode steps in the top bucket, the sampler's
    widest plan), then the whole token `budget` as one prompt."""
    decoding = [
        Request(f"row-{i}", random_prompt(8, 500 + i, vocab_size, avoid), greedy(4, logprobs=20))
        for i in range(rows)
    ]
    prefill = [Request("budget", random_prompt(budget, 3, vocab_size, avoid), greedy(2))]
    return decoding, prefill


def check_graph_memory_is_reserved(checkpoint: Path, vocab_size: int, avoid: Sequence[int] = ()) -> None:
    """Per policy of MEMORY_POLICIES: start as serve would at utilisation 0.9 with every bucket up to
    256, then check the margin (after start-up and after the largest steps) and reserved vs measured."""
    for policy in MEMORY_POLICIES:
        model = load_for_gate(
            checkpoint,
            numeric_policy=policy,
            gpu_memory_utilization=UTILISATION,
            max_num_seqs=MAX_GRAPH_BUCKET,
            num_kv_pages=None,  # explicitly unset: the pool is sized from the measured budget
            kv_cache_memory=None,
            max_num_batched_tokens=SERVE_TOKEN_BUDGET,
        )
        graphs = paged_runner(model).graphs
        if graphs is None:
            raise GraphMemoryError(f"{policy}: the model started without CUDA graphs")
        if graphs.buckets != decode_buckets(MAX_GRAPH_BUCKET):
            raise GraphMemoryError(
                f"{policy}: captured buckets {graphs.buckets}, expected every bucket up to {MAX_GRAPH_BUCKET}"
            )
        if graphs.reserved is None:
            raise GraphMemoryError(f"{policy}: start-up reserved no graph memory in the KV budget")
        reserve = ReserveCheck(graphs.reserved.reserve_bytes, graphs.captured_bytes)
        readings = [read_margin(f"{policy} after start-up", UTILISATION)]
        rows, prefill = _largest_steps(vocab_size, MAX_GRAPH_BUCKET, SERVE_TOKEN_BUDGET, avoid)
        drive(model, rows)
        top = graphs.max_bucket
        if graphs.replays_per_bucket[top] == 0:
            raise GraphMemoryError(f"{policy}: the full batch did not replay bucket {top}")
        drive(model, prefill)
        readings.append(read_margin(f"{policy} after the largest decode and prefill steps", UTILISATION))

        problems = [r.describe() for r in readings if not r.holds]
        if not reserve.within(RESERVE_TOLERANCE_PCT):
            problems.append(
                f"{policy}: graph memory reserved {reserve.reserved / GIB:.3f} GiB, measured "
                f"{reserve.measured / GIB:.3f} GiB ({reserve.diff_pct:+.1f} %, limit ±{RESERVE_TOLERANCE_PCT} %); "
                + _bucket_differences(graphs.reserved.records, graphs.records)
            )
        for reading in readings:
            print(reading.describe())
        print(
            f"{policy}: graph memory reserved {reserve.reserved / GIB:.3f} GiB, measured "
            f"{reserve.measured / GIB:.3f} GiB (trial {graphs.reserved.captured_bytes / GIB:.3f} GiB, of which "
            f"{graphs.reserved.persisted_outside / GIB:.3f} GiB stayed resident)"
        )
        if problems:
            raise GraphMemoryError("; ".join(problems))
        del model, graphs
        torch.cuda.empty_cache()
