"""CUDA graphs for prefill and mixed steps: the forward captured in segments, attention between them.

A step that is not decode-only cannot be one graph: its attention is planned on the host from the
rows' lengths (FlashInfer's prefill plan sizes its work from them). Everything else in a layer
(projections, norms, the prep kernel's RoPE and KV writes, residual adds) depends only on the
number of tokens. So a bucket of T tokens is captured as segments: the model's forward runs once
under capture, and each call into the attention backend ends the segment it is in and begins the
next (`_CutPoints`). A step then replays segment 0, runs layer 0's attention eagerly on the step's
own plan, replays segment 1, and so on: one graph launch and one attention call a layer instead of
every kernel's launch from Python (a 1k prefill of Qwen3-4B: ~380 launches and ~1,500 torch calls,
host-bound at 1.9-2.4x its kernels' time; docs/benchmarks/qwen3.md).

Tokens: the step's n tokens, then T - n filler tokens (token 0 at position 0, in a padding row whose
page table is all the padding page: their KV writes land on page 0 only). Attention runs on the
first n rows. What it reads and writes sits in static buffers, one pair per attention geometry,
shared by every layer and bucket: the segment before copies its query in, the eager call writes its
output, the segment after reads it. So no layer's tensors outlive its segment in the graph pool, and
rows past n never reach a real row (every op outside attention is per row). The forward's output
rows are those of a static `sample_index` (the live ones first, the rest 0); logits are computed
eagerly on the live rows.

`replay=False` runs the same padded buffers eagerly through the same cut points: on the CPU it is
the whole path, and on a GPU what a replay is compared against (tests/engine/test_prefill_graphs.py).
The model line must keep every host-planned op behind `AttentionBackend.run`: lines that say so set
`segments_around_attention = True` (Qwen3, Gemma 4); Qwen3.5's Gated DeltaNet layers plan on the host and
refuse. docs/engine.md, "Prefill graphs", tells the story.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.cuda_graphs import CaptureRecord
from engine.forward_batch import ForwardBatch, PagedCausalLM
from engine.runner import BatchRow
from engine.step_packer import pack_step
from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch
from kernels.kv_layout import PADDING_PAGE, pages_for
from kernels.reference import PagedRows

_FILLER_TOKEN = 0


class PrefillGraphsError(ValueError):
    """A model or configuration prefill graphs cannot serve; the message names it."""


def prefill_buckets(max_tokens: int, smallest: int = 64) -> tuple[int, ...]:
    """Token buckets: 64, 128, 256, 512, then steps of half the last power of two (768, 1024, 1536,
    2048, 3072, ...) up to and always including `max_tokens`. A step pads to the smallest bucket
    that holds it, so past 512 at most a third of a replay is filler."""
    buckets: list[int] = []
    size = smallest
    while size < max_tokens:
        buckets.append(size)
        power = 1 << (size.bit_length() - 1)
        size += power if size < 512 else power // 2
    buckets.append(max_tokens)
    return tuple(buckets)


def refuse_unless_supported(model: PagedCausalLM) -> None:
    """Refuse, by name, a model line whose forward plans anything on the host but attention."""
    if not getattr(model, "segments_around_attention", False):
        raise PrefillGraphsError(
            f"--prefill-graphs: {type(model).__name__} has host-planned work outside attention "
            "(prefill graphs serve Qwen3 and Gemma 4)"
        )


class _Graph(Protocol):
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None: ...
    def capture_end(self) -> None: ...
    def replay(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Hole:
    """One attention call between two segments: its KV group, geometry and pool layer."""

    group: int
    spec: AttentionLayerSpec
    pool_layer: torch.Tensor
    key: tuple[int, int]


class _CutPoints(AttentionBackend):
    """The attention backend the static batches carry: each `run` is a cut point of the forward,
    handed to its `PrefillGraphs`. Never planned: the real backend is."""

    name = "prefill-graph cut points"

    def __init__(self, owner: PrefillGraphs) -> None:
        self._owner = owner

    def plan(
        self, group: int, batch: GroupBatch, layer: AttentionLayerSpec, graph_bucket: int | None = None
    ) -> None:
        raise RuntimeError("prefill-graph cut points are never planned; the real backend is")

    def run(
        self, group: int, layer: AttentionLayerSpec, q: torch.Tensor, pool_layer: torch.Tensor
    ) -> torch.Tensor:
        return self._owner._cut(group, layer, q, pool_layer)


class PrefillGraphs:
    """Owns the static buffers, segment graphs and attention holes of every token bucket of one
    `PagedCausalLM`. Steps of any rows (prefill chunks, decodes, both) whose tokens fit a bucket."""

    def __init__(
        self,
        model: PagedCausalLM,
        attention: AttentionBackend,
        buckets: Sequence[int],
        max_rows: int,
        max_pages_per_seq: int,
        new_graph: Callable[[], _Graph] | None = None,
    ) -> None:
        refuse_unless_supported(model)
        self.model = model
        self.attention = attention
        self.buckets = tuple(sorted(buckets))
        self.max_rows = max_rows
        self.max_pages = max_pages_per_seq
        self._new_graph: Callable[[], _Graph] = new_graph or torch.cuda.CUDAGraph
        device = model.device
        top = self.buckets[-1]
        groups = len(model.kv.shapes)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.int32, device=device)
        # Filler tokens sit in row `max_rows`, whose page table row stays all padding pages.
        self.seq_index = torch.full((top,), max_rows, dtype=torch.int32, device=device)
        self.page_tables = [
            torch.full((max_rows + 1, max_pages_per_seq), PADDING_PAGE, dtype=torch.int32, device=device)
            for _ in range(groups)
        ]
        self.sample_index = torch.zeros(max_rows, dtype=torch.long, device=device)
        dtype = model.kv.dtype
        # One query and one output buffer per attention geometry, shared by every layer and bucket.
        self._queries: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        for spec in model.kv.attention_specs:
            key = (spec.num_heads, spec.head_dim)
            if key not in self._queries:
                self._queries[key] = torch.zeros(top, *key, dtype=dtype, device=device)
                self._outputs[key] = torch.zeros(top, *key, dtype=dtype, device=device)
        # What the buffers above take, allocated outside any capture: start-up reserves it beside
        # the graphs' own pool (the trial capture measures only the captures).
        self.static_bytes = sum(
            t.numel() * t.element_size()
            for t in (
                self.input_ids,
                self.positions,
                self.seq_index,
                self.sample_index,
                *self.page_tables,
                *self._queries.values(),
                *self._outputs.values(),
            )
        )
        cut_points = _CutPoints(self)
        self._batches = {
            b: ForwardBatch(
                input_ids=self.input_ids[:b],
                positions=self.positions[:b],
                rows=tuple(PagedRows(self.positions[:b], self.seq_index[:b], t) for t in self.page_tables),
                sample_index=self.sample_index,
                attention=cut_points,
            )
            for b in self.buckets
        }
        # Per bucket: its segments, the holes between them, and the forward's output rows.
        self._segments: dict[int, list[_Graph]] = {}
        self._holes: dict[int, list[_Hole]] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        self.records: list[CaptureRecord] = []
        # The step's real token count, read by the cut points in an eager run.
        self._live_tokens = 0
        # While capturing: the bucket's segments and holes so far.
        self._capturing: tuple[list[_Graph], list[_Hole]] | None = None
        self.steps_per_bucket: dict[int, int] = dict.fromkeys(self.buckets, 0)
        self.replays_per_bucket: dict[int, int] = dict.fromkeys(self.buckets, 0)

    @property
    def captured_bytes(self) -> int:
        return sum(r.bytes_added for r in self.records)

    def bucket_for(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    def accepts(self, rows: Sequence[BatchRow]) -> bool:
        return (
            0 < len(rows) <= self.max_rows
            and sum(len(r.token_ids) for r in rows) <= self.buckets[-1]
            and all(len(t) <= self.max_pages for r in rows for t in r.page_tables)
        )

    # -- a step ------------------------------------------------------------------------------

    def load(self, step: ForwardBatch, feed: Callable[[torch.Tensor], None] | None = None) -> int:
        """Copy a step packed on the host (its own rows, planned on the real backend) into the
        static inputs of its bucket, filler tokens after it; returns the bucket. `feed` then
        rewrites, on the device, the tokens of rows fed from the previous step (async scheduling)."""
        tokens = step.num_tokens
        bucket = self.bucket_for(tokens)
        if bucket is None:
            raise ValueError(f"{tokens} tokens fit no prefill-graph bucket (buckets {self.buckets})")
        rows = step.rows[0].page_table.shape[0]
        sampled = step.sample_index.shape[0]
        if rows > self.max_rows or sampled > self.max_rows:
            raise ValueError(
                f"{rows} rows ({sampled} sampled) exceed the {self.max_rows} prefill graphs hold"
            )
        self.input_ids[:tokens].copy_(step.input_ids, non_blocking=True)
        self.positions[:tokens].copy_(step.positions, non_blocking=True)
        self.seq_index[:tokens].copy_(step.rows[0].seq_index, non_blocking=True)
        for static, packed in zip(self.page_tables, step.rows, strict=True):
            static[:rows, : packed.page_table.shape[1]].copy_(packed.page_table, non_blocking=True)
        self.sample_index[:sampled].copy_(step.sample_index, non_blocking=True)
        # What the last step left past this one's tokens and sampled rows.
        self.input_ids[tokens:bucket].fill_(_FILLER_TOKEN)
        self.positions[tokens:bucket].fill_(0)
        self.seq_index[tokens:bucket].fill_(self.max_rows)
        self.sample_index[sampled:].fill_(0)
        self._live_tokens = tokens
        if feed is not None:
            feed(self.input_ids[:tokens])
        return bucket

    def run(self, bucket: int, sampled: int, replay: bool = True) -> torch.Tensor:
        """The forward's hidden rows of the `sampled` live sampling rows, over what `load` put in
        place: segments replayed with attention between them, or (`replay=False`) the forward run
        eagerly on the same buffers."""
        self.steps_per_bucket[bucket] += 1
        if not replay:
            with torch.inference_mode():
                return self.model.forward(self._batches[bucket])[:sampled]
        segments, holes = self._segments[bucket], self._holes[bucket]
        self.replays_per_bucket[bucket] += 1
        for segment, hole in zip(segments, holes, strict=False):
            segment.replay()
            self._attend(hole)
        segments[-1].replay()
        return self._hidden[bucket][:sampled]

    def _attend(self, hole: _Hole) -> None:
        """One layer's attention on the live rows, between two replayed segments."""
        n = self._live_tokens
        query, output = self._queries[hole.key], self._outputs[hole.key]
        output[:n].copy_(self.attention.run(hole.group, hole.spec, query[:n], hole.pool_layer))

    def _cut(
        self, group: int, spec: AttentionLayerSpec, q: torch.Tensor, pool_layer: torch.Tensor
    ) -> torch.Tensor:
        """A call into attention from the forward over a static batch: its query goes to the static
        buffer; under capture the segment ends there and the next begins, otherwise the attention
        runs at once. Returns the static output rows the rest of the forward reads."""
        key = (int(q.shape[1]), int(q.shape[2]))
        tokens = q.shape[0]
        self._queries[key][:tokens].copy_(q)
        hole = _Hole(group, spec, pool_layer, key)
        if self._capturing is None:
            self._attend(hole)
        else:
            segments, holes = self._capturing
            segments[-1].capture_end()
            holes.append(hole)
            segment = self._new_graph()
            segment.capture_begin(pool=self.pool)
            segments.append(segment)
        return self._outputs[key][:tokens]

    # -- capture ------------------------------------------------------------------------------

    def _load_warm_up(self, bucket: int) -> None:
        """A one-row prefill of the whole bucket on pages 1.. (start-up's pools hold them), planned
        on the real backend, in the static inputs."""
        specs = self.model.kv.attention_specs
        pages = tuple(range(1, 1 + pages_for(bucket)))
        row = BatchRow.whole_prompt("prefill-graph warm-up", (0,) * bucket, (pages,) * len(specs))
        self.load(pack_step([row], specs, self.attention).to(self.model.device))

    def capture(self, on_bucket: Callable[[CaptureRecord], None] | None = None) -> None:
        """Warm up, then capture every bucket's segments, largest first, into one memory pool."""
        device = self.model.device
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        for bucket in sorted(self.buckets, reverse=True):
            self._load_warm_up(bucket)
            start = time.perf_counter()
            with torch.inference_mode():
                self.model.forward(self._batches[bucket])  # compiles kernels outside the capture
                torch.cuda.synchronize(device)
                gc.collect()
                torch.cuda.empty_cache()
                free_before, _ = torch.cuda.mem_get_info(device)
                reserved_before = torch.cuda.memory_reserved(device)
                segments: list[_Graph] = [self._new_graph()]
                holes: list[_Hole] = []
                self._capturing = (segments, holes)
                try:
                    with torch.cuda.stream(stream):
                        segments[0].capture_begin(pool=self.pool)
                        hidden = self.model.forward(self._batches[bucket])
                        segments[-1].capture_end()
                finally:
                    self._capturing = None
            torch.cuda.synchronize(device)
            self._segments[bucket], self._holes[bucket], self._hidden[bucket] = segments, holes, hidden
            free_after, _ = torch.cuda.mem_get_info(device)
            record = CaptureRecord(
                bucket,
                free_before,
                free_after,
                reserved_before,
                torch.cuda.memory_reserved(device),
                time.perf_counter() - start,
            )
            self.records.append(record)
            if on_bucket is not None:
                on_bucket(record)

    def segments_per_bucket(self) -> dict[int, int]:
        return {bucket: len(segments) for bucket, segments in self._segments.items()}
