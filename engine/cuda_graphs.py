"""CUDA-graph decode: one captured forward per batch bucket, replayed for decode-only steps.

A decode step of n rows runs in the smallest bucket B >= n, rows n..B-1 filler rows
(engine.step_packer says what they are). Every bucket reads the same static input buffers (their
first B rows), loaded from the packed step, and is captured largest first into one shared memory
pool. The graph covers the model's forward and its logits; sampling runs eagerly on the live rows,
so the cheapest sampler plan serves each step.

`replay=False` runs the same padded buffers eagerly instead of replaying: the graph gate compares
the two bit for bit.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from engine.forward_batch import ForwardBatch, PagedCausalLM
from engine.graph_budget import capture_out_of_memory
from engine.runner import BatchRow
from engine.step_packer import pack_step
from kernels.attention.base import AttentionBackend
from kernels.reference import PagedRows

MAX_GRAPH_BUCKET = 256
_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, then every 16 up to max_num_seqs (capped at 256); the largest
    bucket always covers max_num_seqs (up to the cap)."""
    top = min(max_num_seqs, MAX_GRAPH_BUCKET)
    buckets = [b for b in _SMALL_BUCKETS if b < top]
    b = 48
    while b < top:
        buckets.append(b)
        b += 16
    buckets.append(top)
    return tuple(sorted(set(buckets)))


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    for b in buckets:
        if b >= rows:
            return b
    return None


@dataclass(frozen=True, slots=True)
class CaptureRecord:
    bucket: int
    free_before: int
    free_after: int
    # The torch allocator's reserved bytes around the capture: the shared graph pool's growth.
    reserved_before: int
    reserved_after: int
    seconds: float

    @property
    def pool_bytes(self) -> int:
        return self.reserved_after - self.reserved_before

    @property
    def bytes_added(self) -> int:
        return self.free_before - self.free_after


def outside_torch_bytes() -> int:
    """Device memory in use that torch's allocator does not hold (the CUDA context, loaded kernel
    modules, instantiated graphs, library handles), other processes' included."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


@dataclass(frozen=True, slots=True)
class TrialCapture:
    """A throwaway capture of every bucket, made before the KV pool exists to measure what the
    graphs will take once it does (they must be captured against the real pool)."""

    records: tuple[CaptureRecord, ...]
    # Memory outside torch's allocator that the trial's captures took and that stayed once its
    # graphs were dropped: kernel modules first loaded inside a capture window (cuBLAS picks its
    # kernels per row count, and may pick others under capture than in the eager warm-up). It is
    # in `records`, stays resident, and the real capture does not take it again.
    persisted_outside: int

    @property
    def captured_bytes(self) -> int:
        return sum(r.bytes_added for r in self.records)

    @property
    def reserve_bytes(self) -> int:
        """What the real capture is expected to take: the trial's figure less what stayed."""
        return max(0, self.captured_bytes - self.persisted_outside)


class CapturedGraphs(Protocol):
    """What start-up measures and captures: a graph set with buckets, captured largest first
    (`GraphedDecode`, `engine.prefill_graphs.PrefillGraphs`)."""

    buckets: tuple[int, ...]
    records: list[CaptureRecord]

    def capture(self, on_bucket: Callable[[CaptureRecord], None] | None = None) -> None: ...


G = TypeVar("G", bound=CapturedGraphs)


def trial_capture(
    graphs: G, capture: Callable[[G], object], policy: str, kind: str = "decode"
) -> TrialCapture:
    """Capture `graphs` with `capture`, drop them, and say what they took and what stayed. The
    caller must hold no other reference to `graphs`. Running out of device memory on the way is
    refused with a `MemoryBudgetError` naming the bucket (graph_budget.capture_out_of_memory)."""
    outside_before = outside_torch_bytes()
    try:
        capture(graphs)
    except torch.cuda.OutOfMemoryError as exc:
        # The traceback holds the graphs until the caller lets go of the error; freeing is its job.
        captured = [r.bucket for r in graphs.records]
        failed = max((b for b in graphs.buckets if b not in captured), default=min(graphs.buckets))
        raise capture_out_of_memory(failed, captured, policy, kind) from exc
    records = tuple(graphs.records)
    del graphs
    gc.collect()
    torch.cuda.empty_cache()
    return TrialCapture(records, max(0, outside_torch_bytes() - outside_before))


class GraphedDecode:
    """Owns the static buffers and graphs of one `PagedCausalLM` (see engine.model_runner)."""

    def __init__(
        self,
        model: PagedCausalLM,
        attention: AttentionBackend,
        buckets: Sequence[int],
        max_pages_per_seq: int,
    ) -> None:
        if not attention.supports_graphs:
            raise ValueError(f"attention backend {attention.name!r} cannot be captured in a CUDA graph")
        self.model = model
        self.attention = attention
        self.buckets = tuple(sorted(buckets))
        self.max_pages = max_pages_per_seq
        device = self.model.device
        top = self.buckets[-1]
        groups = len(self.model.kv.shapes)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.int32, device=device)
        self.seq_index = torch.arange(top, dtype=torch.int32, device=device)
        self.page_tables = [
            torch.zeros(top, max_pages_per_seq, dtype=torch.int32, device=device) for _ in range(groups)
        ]
        self.sample_index = torch.arange(top, dtype=torch.long, device=device)
        self.state_slots = torch.zeros(top, dtype=torch.long, device=device)
        self._batches = {
            b: ForwardBatch(
                input_ids=self.input_ids[:b],
                positions=self.positions[:b],
                rows=tuple(
                    PagedRows(self.positions[:b], self.seq_index[:b], t[:b]) for t in self.page_tables
                ),
                sample_index=self.sample_index[:b],
                attention=attention,
                state_slots=self.state_slots[:b],
            )
            for b in self.buckets
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        self.records: list[CaptureRecord] = []
        # Steps served per bucket (replayed or, with replay=False, run eagerly on its buffers).
        self.steps_per_bucket: dict[int, int] = dict.fromkeys(self.buckets, 0)
        # Steps whose forward was a replay of the bucket's captured graph (a subset of the above).
        self.replays_per_bucket: dict[int, int] = dict.fromkeys(self.buckets, 0)
        # The trial capture from which start-up set graph memory aside in the KV budget; None when
        # nothing was reserved. `captured_bytes` is what these graphs took.
        self.reserved: TrialCapture | None = None

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    @property
    def reserved_bytes(self) -> int | None:
        return None if self.reserved is None else self.reserved.reserve_bytes

    @property
    def captured_bytes(self) -> int:
        """Device memory the captures took: the sum of every bucket's free-memory drop."""
        return sum(r.bytes_added for r in self.records)

    def bucket_for(self, rows: int) -> int | None:
        return bucket_for(rows, self.buckets)

    def accepts(self, rows: Sequence[BatchRow]) -> bool:
        return (
            len(rows) <= self.max_bucket
            and all(len(r.token_ids) == 1 and r.sample for r in rows)
            and all(len(t) <= self.max_pages for r in rows for t in r.page_tables)
        )

    def _load(self, step: ForwardBatch) -> None:
        """Copy a packed step (padded to its bucket, planned into the bucket's buffers) into the
        static inputs. Only the page-table columns some row uses are written: entries past a row's
        last page are never read (the prep kernel reads page pos // 16 for pos < kv_len; FlashInfer
        reads the indices it was planned with)."""
        bucket = step.num_tokens
        self.input_ids[:bucket].copy_(step.input_ids, non_blocking=True)
        self.positions[:bucket].copy_(step.positions, non_blocking=True)
        for static, rows in zip(self.page_tables, step.rows, strict=True):
            static[:bucket, : rows.page_table.shape[1]].copy_(rows.page_table, non_blocking=True)
        if step.state_slots is not None:
            self.state_slots[:bucket].copy_(step.state_slots, non_blocking=True)

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model.logits(self.model.forward(self._batches[bucket]))

    def capture(self, on_bucket: Callable[[CaptureRecord], None] | None = None) -> None:
        """Warm up, then capture every bucket, largest first, into one memory pool."""
        import time

        specs = self.model.kv.attention_specs
        for bucket in sorted(self.buckets, reverse=True):
            self._load(pack_step([], specs, self.attention, bucket=bucket))
            start = time.perf_counter()
            with torch.inference_mode():
                # Compile kernels and settle the allocator outside the capture, so the free-memory
                # delta below is the graph's own pool growth.
                self._forward(bucket)
                torch.cuda.synchronize()
                # torch.cuda.graph empties the allocator cache on entry; do it first so that release
                # is not counted as negative graph memory.
                gc.collect()
                torch.cuda.empty_cache()
                free_before, _ = torch.cuda.mem_get_info()
                reserved_before = torch.cuda.memory_reserved()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._logits[bucket] = self._forward(bucket)
            torch.cuda.synchronize()
            if self.pool is None:
                self.pool = graph.pool()
            self._graphs[bucket] = graph
            free_after, _ = torch.cuda.mem_get_info()
            record = CaptureRecord(
                bucket,
                free_before,
                free_after,
                reserved_before,
                torch.cuda.memory_reserved(),
                time.perf_counter() - start,
            )
            self.records.append(record)
            if on_bucket is not None:
                on_bucket(record)

    def graph_for(self, rows: int) -> torch.cuda.CUDAGraph | None:
        bucket = bucket_for(rows, self.buckets)
        return None if bucket is None else self._graphs.get(bucket)

    def logits(self, step: ForwardBatch, live_rows: int, replay: bool = True) -> torch.Tensor:
        """Float32 logits [live_rows, vocab] of a decode step packed into its bucket (on the host)."""
        self.load(step)
        return self.run(step.num_tokens, live_rows, replay)

    def load(self, step: ForwardBatch, feed: Callable[[torch.Tensor], None] | None = None) -> None:
        """Copy a decode step packed into its bucket (on the host) into the static inputs; `feed`
        then rewrites, on the device, the tokens of rows fed from the previous step (async
        scheduling), given the bucket's view of the static token ids."""
        bucket = step.num_tokens
        if bucket not in self._graphs:
            raise ValueError(f"no graph was captured for bucket {bucket} (buckets {self.buckets})")
        self._load(step)
        if feed is not None:
            feed(self.input_ids[:bucket])

    def run(self, bucket: int, live_rows: int, replay: bool = True) -> torch.Tensor:
        """Float32 logits [live_rows, vocab] of the bucket's graph over what `load` put in place."""
        if bucket not in self._graphs:
            raise ValueError(f"no graph was captured for bucket {bucket} (buckets {self.buckets})")
        self.steps_per_bucket[bucket] += 1
        if replay:
            self.replays_per_bucket[bucket] += 1
            self._graphs[bucket].replay()
            return self._logits[bucket][:live_rows]
        with torch.inference_mode():
            return self._forward(bucket)[:live_rows]
