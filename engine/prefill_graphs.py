"""CUDA graphs for prefill and mixed steps: the forward captured in segments, host-planned ops between.

A step that is not decode-only cannot be one graph: its attention is planned on the host from the
rows' lengths (FlashInfer's prefill plan sizes its work from them), and so are a recurrent layer's
varlen kernels (Qwen3.5's conv and chunked delta rule). Everything else in a layer (projections,
norms, the prep kernel's RoPE and KV writes, residual adds) depends only on the number of tokens.
So a bucket of T tokens is captured as segments: the model's forward runs once under capture, and
each call into the attention backend (`_CutPoints`) or `ForwardBatch.host_planned` ends the segment
it is in and begins the next. A step then replays segment 0, runs the first host-planned op
eagerly on the step itself, replays segment 1, and so on: one graph launch and one eager op a cut
instead of every kernel's launch from Python (a 1k prefill of Qwen3-4B: ~380 launches and ~1,500
torch calls, host-bound at 1.9-2.4x its kernels' time; docs/benchmarks/qwen3.md).

Tokens: the step's n tokens, then T - n filler tokens (token 0 at position 0, in a padding row whose
page table is all the padding page: their KV writes land on page 0 only). The eager ops run on the
first n rows. What they read and write sits in static buffers, one pair per kind of cut (attention
geometry, or host-planned op), shared by every layer and bucket: the segment before copies the input
in, the eager op writes its output, the segment after reads it. So no layer's tensors outlive its
segment in the graph pool, and rows past n never reach a real row (every op outside the cuts is per
row). The forward's output rows are those of a static `sample_index` (the live ones first, the rest
0); logits are computed eagerly on the live rows.

`replay=False` runs the same padded buffers eagerly through the same cut points: on the CPU it is
the whole path, and on a GPU what a replay is compared against (tests/engine/test_prefill_graphs.py).
The model line must keep every host-planned op behind `AttentionBackend.run` or
`ForwardBatch.host_planned`; lines that do say so with `segmented_capture = True` (Qwen3, Gemma 3,
Gemma 4, Qwen3.5). docs/engine.md, "Prefill graphs", tells the story.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from engine.cuda_graphs import CaptureRecord
from engine.forward_batch import ForwardBatch, HostPlannedOp, PagedCausalLM
from engine.kv.state_pool import PADDING_SLOT
from engine.runner import BatchRow
from engine.step_packer import pack_step
from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE, pages_for
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


def fillable_tokens(max_rows: int, max_pages_per_seq: int) -> int:
    """The most tokens one step can hold: `max_rows` rows, each as long as its page table allows."""
    return max_rows * max_pages_per_seq * PAGE_SIZE


def refuse_unless_supported(model: PagedCausalLM) -> None:
    """Refuse, by name, a model line that has not put its host-planned ops behind cut points."""
    if not getattr(model, "segmented_capture", False):
        raise PrefillGraphsError(
            f"--prefill-graphs: {type(model).__name__} plans work on the host outside the cut points "
            "(attention, ForwardBatch.host_planned)"
        )


class _Graph(Protocol):
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None: ...
    def capture_end(self) -> None: ...
    def replay(self) -> None: ...


# One eager op between two segments: given the step's live token count, it reads its static input
# rows and writes its static output rows.
_Hole = Callable[[int], None]


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
        return self._owner._attention_cut(group, layer, q, pool_layer)


class PrefillGraphs:
    """Owns the static buffers, segment graphs and cut points' eager ops of every token bucket of one
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
        self.buckets = tuple(sorted(buckets))
        if self.buckets[-1] > fillable_tokens(max_rows, max_pages_per_seq):
            raise PrefillGraphsError(
                f"a prefill-graph bucket of {self.buckets[-1]} tokens cannot be filled by {max_rows} rows "
                f"of at most {max_pages_per_seq * PAGE_SIZE} tokens"
            )
        self.model = model
        self.attention = attention
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
        self.state_slots = torch.full((max_rows,), PADDING_SLOT, dtype=torch.long, device=device)
        # Per kind of cut, its input and output rows, shared by every layer and bucket; made by the
        # first eager run (the largest bucket's warm-up), never inside a capture.
        self._inputs: dict[tuple[object, ...], torch.Tensor] = {}
        self._outputs: dict[tuple[object, ...], torch.Tensor] = {}
        cut_points = _CutPoints(self)
        # Every static batch says one row of all its tokens: a segment may assume only that a step is
        # not one token per row (its rows are the eager ops' business, `_live`).
        self._batches = {
            b: ForwardBatch(
                input_ids=self.input_ids[:b],
                positions=self.positions[:b],
                rows=tuple(PagedRows(self.positions[:b], self.seq_index[:b], t) for t in self.page_tables),
                sample_index=self.sample_index,
                attention=cut_points,
                state_slots=self.state_slots[:1],
                cu_seqlens=(0, b),
                cuts=self,
            )
            for b in self.buckets
        }
        # The step `load` put in place, over the static buffers' live rows: what host-planned ops read.
        self._live: ForwardBatch | None = None
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

    @property
    def static_bytes(self) -> int:
        """What the static buffers take, allocated outside any capture: start-up reserves it beside
        the graphs' own pool (a trial capture measures only the captures). Complete once a bucket
        has run."""
        return sum(
            t.numel() * t.element_size()
            for t in (
                self.input_ids,
                self.positions,
                self.seq_index,
                self.sample_index,
                self.state_slots,
                *self.page_tables,
                *self._inputs.values(),
                *self._outputs.values(),
            )
        )

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
        slots = None
        if step.state_slots is not None:
            slots = self.state_slots[:rows]
            slots.copy_(step.state_slots, non_blocking=True)
        # What the last step left past this one's tokens and sampled rows.
        self.input_ids[tokens:bucket].fill_(_FILLER_TOKEN)
        self.positions[tokens:bucket].fill_(0)
        self.seq_index[tokens:bucket].fill_(self.max_rows)
        self.sample_index[sampled:].fill_(0)
        self._live_tokens = tokens
        self._live = ForwardBatch(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            rows=tuple(
                PagedRows(self.positions[:tokens], self.seq_index[:tokens], t) for t in self.page_tables
            ),
            sample_index=self.sample_index[:sampled],
            attention=self.attention,
            state_slots=slots,
            cu_seqlens=step.cu_seqlens,
        )
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
            hole(self._live_tokens)
        segments[-1].replay()
        return self._hidden[bucket][:sampled]

    def _attention_cut(
        self, group: int, spec: AttentionLayerSpec, q: torch.Tensor, pool_layer: torch.Tensor
    ) -> torch.Tensor:
        """A call into attention from the forward over a static batch: on the step's own plan."""

        def attend(query: torch.Tensor) -> torch.Tensor:
            return self.attention.run(group, spec, query, pool_layer)

        return self._cut(("attention", *q.shape[1:]), attend, q, q.shape[1:])

    def cut(self, name: str, op: HostPlannedOp, x: torch.Tensor, width: int) -> torch.Tensor:
        """`ForwardBatch.host_planned` over a static batch: `op` on the live step's rows."""

        def planned(rows: torch.Tensor) -> torch.Tensor:
            assert self._live is not None, "a host-planned op ran before any step was loaded"
            return op(rows, self._live)

        return self._cut((name, *x.shape[1:], width), planned, x, (width,))

    def _cut(
        self,
        key: tuple[object, ...],
        op: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        out_shape: Sequence[int],
    ) -> torch.Tensor:
        """A cut point: `x` goes to the static input rows; under capture the segment ends there and
        the next begins, otherwise `op` runs at once on the live rows. Returns the static output
        rows the rest of the forward reads."""
        if key not in self._inputs:
            if self._capturing is not None:
                raise RuntimeError(f"prefill graphs: cut {key} first met inside a capture (no warm-up ran)")
            top = self.buckets[-1]
            self._inputs[key] = torch.zeros(top, *x.shape[1:], dtype=x.dtype, device=x.device)
            self._outputs[key] = torch.zeros(top, *out_shape, dtype=x.dtype, device=x.device)
        inputs, outputs = self._inputs[key], self._outputs[key]
        tokens = x.shape[0]
        inputs[:tokens].copy_(x)

        def hole(n: int) -> None:
            outputs[:n].copy_(op(inputs[:n]).reshape(n, *out_shape))

        if self._capturing is None:
            hole(self._live_tokens)
        else:
            segments, holes = self._capturing
            segments[-1].capture_end()
            holes.append(hole)
            segment = self._new_graph()
            segment.capture_begin(pool=self.pool)
            segments.append(segment)
        return outputs[:tokens]

    # -- capture ------------------------------------------------------------------------------

    def _load_warm_up(self, bucket: int) -> None:
        """A prefill of the whole bucket on pages 1.. (start-up's pools hold them), planned on the
        real backend, in the static inputs: as few rows as the page tables allow (a row holds at
        most `max_pages` pages, so a context limit below the bucket splits it)."""
        specs = self.model.kv.attention_specs
        longest = self.max_pages * PAGE_SIZE
        rows: list[BatchRow] = []
        first_page = 1
        for start in range(0, bucket, longest):
            length = min(longest, bucket - start)
            pages = tuple(range(first_page, first_page + pages_for(length)))
            first_page += len(pages)
            name = f"prefill-graph warm-up {len(rows)}"
            rows.append(BatchRow.whole_prompt(name, (0,) * length, (pages,) * len(specs)))
        self.load(pack_step(rows, specs, self.attention).to(self.model.device))

    @torch.inference_mode()
    def capture(self, on_bucket: Callable[[CaptureRecord], None] | None = None) -> None:
        """Warm up, then capture every bucket's segments, largest first, into one memory pool.
        All of it in inference mode, as the runner's steps: start-up's profile step made the
        backend's plan buffers there, and such a tensor takes no in-place update outside it."""
        device = self.model.device
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        for bucket in sorted(self.buckets, reverse=True):
            self._load_warm_up(bucket)
            start = time.perf_counter()
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
