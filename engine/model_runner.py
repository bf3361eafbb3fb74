"""PagedModelRunner: one forward of a paged causal LM per `StepBatch`, then sampling on its device.

Rows become tensors in engine.step_packer; decode-only steps that fit a bucket replay a captured
graph (engine.cuda_graphs), and with `--prefill-graphs` other steps that fit a token bucket replay
segments cut at host-planned ops (engine.prefill_graphs). The model owns its weights and KV pools;
the runner owns no policy.
Overlapped prefill runs its forward on a side CUDA stream with its own attention instance
(`AttentionBackend.sibling`) and hands only the logits to the main stream (docs/engine.md).

Async scheduling (`launch_step`) runs a step with no wait on the host: inputs go to the device
through pinned buffers, rows fed from the previous step take their tokens from its sampled-id
tensor on the device, and the sampled ids and log-probs come back into pinned buffers behind a CUDA
event that `collect` waits on. Everything is queued on one stream, so a step reads the KV and the
tokens every step launched before it wrote.

A recurrent model's state snapshots (engine/kv/snapshots.py) are slot copies on the device that a
step makes before its forward (`StepBatch.restore_state`) and after it (`StepBatch.snapshot_state`),
on the stream the forward runs on: a synchronous step and a launched one alike (`_copy_state`);
overlapped prefill refuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np
import torch

from engine.cuda_graphs import GraphedDecode
from engine.forward_batch import HostStaging, PagedCausalLM, StagingRing
from engine.kv.state_pool import state_pools_of
from engine.prefill_graphs import PrefillGraphs
from engine.runner import (
    BatchRow,
    FeedError,
    PrefillHandle,
    ReadyPrefill,
    SampledToken,
    StepBatch,
    StepHandle,
)
from engine.sampling import SamplerOutput, sample
from engine.sampling_batch import SamplingBatch, SamplingColumnsCache, SeedSource
from engine.step_packer import PageTableCache, pack_step
from kernels.attention.base import AttentionBackend


def sample_rows(
    rows: Sequence[BatchRow],
    logits: torch.Tensor | None,
    seeds: SeedSource,
    *,
    triton_draw: bool = False,
    columns: SamplingColumnsCache | None = None,
) -> list[SampledToken | None]:
    """Sample the rows with `sample` from `logits` (one row each, in order); None for the others.
    `columns`: the sampling batch is packed through it (`SamplingBatch.of_step`)."""
    if logits is None:
        return [None] * len(rows)
    params = SamplingBatch.of_step(rows, seeds, columns)
    picked = sample(logits, params.to(logits.device), params.plan, triton_draw=triton_draw)
    return _in_rows(picked.to_sampled_tokens(params.logprobs_requested), [row.sample for row in rows])


def _in_rows(sampled: list[SampledToken], samples: Sequence[bool]) -> list[SampledToken | None]:
    """The sampling rows' tokens (in order) placed at the rows that sample, None at the others."""
    if len(sampled) == len(samples):
        return list(sampled)  # every row samples: already in row order
    tokens = iter(sampled)
    return [next(tokens) if row_samples else None for row_samples in samples]


class PagedModelRunner:
    """Runs any `PagedCausalLM`: decode-only steps through captured CUDA graphs when it has them,
    other steps through prefill graphs when it has those, everything else eagerly. Implements
    `engine.runner.ModelRunner`."""

    def __init__(
        self,
        model: PagedCausalLM,
        attention: AttentionBackend,
        seeds: SeedSource | None = None,
        graphs: GraphedDecode | None = None,
        side_attention: AttentionBackend | None = None,
        prefill_graphs: PrefillGraphs | None = None,
        *,
        triton_draw: bool = False,
    ) -> None:
        self.model = model
        # The sampled rows' draw through the Triton kernel (`--sampling-backend triton`).
        self.triton_draw = triton_draw
        self.attention = attention
        self.seeds = seeds or SeedSource()
        self.graphs = graphs
        self.prefill_graphs = prefill_graphs
        # False: graphed steps run their padded buffers eagerly (the graph gate's comparison).
        self.replay_graphs = True
        # Overlapped prefill's stream and attention instance. Start-up passes the instance in when
        # --async-prefill is on, so its workspace is counted before the KV pool is sized; otherwise
        # it is made on the first launch.
        self._stream: torch.cuda.Stream | None = None
        self._side_backend: AttentionBackend | None = side_attention
        # The pinned buffers launches pass through (async scheduling), and an event behind the last
        # main-stream step's input copies (the attention backend's plan copies included), which the
        # next plan waits for (`_wait_for_inputs`).
        self._staging = StagingRing(model.device)
        self._inputs_queued: torch.cuda.Event | None = None
        # The main stream's steps (eager, graphed, launched) pack their page tables from the last
        # one's; overlapped prefill's side forwards pack theirs whole.
        self._tables = PageTableCache()
        # Likewise their sampling batches, from the last one's columns.
        self._sampling_columns = SamplingColumnsCache()

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        return sample_rows(
            batch.rows,
            self.forward(batch),
            self.seeds,
            triton_draw=self.triton_draw,
            columns=self._sampling_columns,
        )

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's forward and its state copies, without sampling: the logits of the sampling
        rows, None when no row samples. What every tensor-parallel rank runs; rank 0 then samples."""
        rows = batch.rows
        graphs = self.graphs
        on_cuda = self.model.device.type == "cuda"
        # A step that samples nothing (a prefill chunk) returns without the host waiting for the
        # device, so the next plan could rewrite the pinned buffers its queued input copies still
        # read; as in `launch_step`, planning waits for the previous step's input copies.
        self._wait_for_inputs()
        self._copy_state(batch.restore_state)
        if graphs is not None and graphs.accepts(rows):
            step = pack_step(
                rows,
                self.model.kv.attention_specs,
                self.attention,
                bucket=graphs.bucket_for(len(rows)),
                table_cache=self._tables,
            )
            logits: torch.Tensor | None = graphs.logits(step, len(rows), replay=self.replay_graphs)
            self._inputs_queued = _record_event(on_cuda)
        elif self.prefill_graphs is not None and self.prefill_graphs.accepts(rows):
            step = pack_step(rows, self.model.kv.attention_specs, self.attention, table_cache=self._tables)
            bucket = self.prefill_graphs.load(step)
            self._inputs_queued = _record_event(on_cuda)
            logits = self._segmented_logits(rows, bucket)
        else:
            logits = self._eager_logits(rows, self.attention, self._tables, mark_inputs=True)
        self._copy_state(batch.snapshot_state)
        return logits

    def _wait_for_inputs(self) -> None:
        """Wait until the previous step's input copies (and the plan copies queued before them)
        have run: only then may a plan rewrite the pinned buffers they read."""
        if self._inputs_queued is not None:
            self._inputs_queued.synchronize()
            self._inputs_queued = None

    def _copy_state(self, copies: Sequence[tuple[int, int]]) -> None:
        """A step's state-slot copies (source, destination), in order, queued on the current stream:
        its restores just before its forward, its snapshots just after it."""
        if not copies:
            return
        state = state_pools_of(self.model)
        if state is None:
            raise ValueError(
                f"{type(self.model).__name__} has no state pool, yet a step asks for state copies"
            )
        state.copy_slots(copies)

    @staticmethod
    def _refuse_state_copies(batch: StepBatch, mode: str) -> None:
        if batch.restore_state or batch.snapshot_state:
            raise ValueError(f"state snapshots are not supported with {mode} (the scheduler refuses it)")

    @torch.inference_mode()
    def launch_step(self, batch: StepBatch, feed: StepHandle | None) -> StepHandle:
        """Implements `engine.runner.PipelinedRunner`: the step queued on the current stream, its
        tokens read at `collect`. No host-device synchronisation happens here except the wait for
        the previous launch's input copies (already done once the step before that was collected):
        the attention backend may reuse its own pinned planning buffer in `plan`."""
        rows = batch.rows
        device = self.model.device
        on_cuda = device.type == "cuda"
        self._wait_for_inputs()
        slot, staging = self._staging.take()
        try:
            # Before the forward, as `forward` makes them; the snapshots follow the logits.
            self._copy_state(batch.restore_state)
            graphs = self.graphs
            specs = self.model.kv.attention_specs
            if graphs is not None and graphs.accepts(rows):
                bucket = graphs.bucket_for(len(rows))
                assert bucket is not None
                packed = pack_step(rows, specs, self.attention, bucket=bucket, table_cache=self._tables)
                fed = self._feeder(rows, packed.cu_seqlens, feed, staging)
                graphs.load(packed.pinned(staging), fed)
                self._inputs_queued = _record_event(on_cuda)
                logits: torch.Tensor | None = graphs.run(bucket, len(rows), replay=self.replay_graphs)
            elif self.prefill_graphs is not None and self.prefill_graphs.accepts(rows):
                packed = pack_step(rows, specs, self.attention, table_cache=self._tables)
                fed = self._feeder(rows, packed.cu_seqlens, feed, staging)
                bucket = self.prefill_graphs.load(packed.pinned(staging), fed)
                self._inputs_queued = _record_event(on_cuda)
                logits = self._segmented_logits(rows, bucket)
            else:
                step = pack_step(rows, specs, self.attention, table_cache=self._tables)
                fed = self._feeder(rows, step.cu_seqlens, feed, staging)
                step = step.pinned(staging).to(device)
                if fed is not None:
                    fed(step.input_ids)
                self._inputs_queued = _record_event(on_cuda)
                hidden = self.model.forward(step)
                logits = self.model.logits(hidden) if any(r.sample for r in rows) else None
            self._copy_state(batch.snapshot_state)
            host: SamplerOutput | None = None
            device_tokens: torch.Tensor | None = None
            requested: tuple[int | None, ...] = ()
            if logits is not None:
                params = SamplingBatch.of_step(rows, self.seeds, self._sampling_columns)
                picked = sample(logits, params.to(device, staging), params.plan, triton_draw=self.triton_draw)
                device_tokens = picked.token_ids
                host = picked.to_host(staging)
                requested = params.logprobs_requested
            finished = _record_event(on_cuda)
        except BaseException:
            # The contract: nothing this launch started is left running behind an exception.
            if on_cuda:
                torch.cuda.current_stream(device).synchronize()
            self._inputs_queued = None
            raise
        self._staging.release_after(slot, finished)
        return _LaunchedStep(self, rows, device_tokens, host, requested, finished)

    def _feeder(
        self,
        rows: Sequence[BatchRow],
        cu_seqlens: tuple[int, ...] | None,
        feed: StepHandle | None,
        staging: HostStaging,
    ) -> Callable[[torch.Tensor], None] | None:
        """What rewrites the packed token ids of rows fed from `feed` on the device, or None.
        `cu_seqlens`: the packed step's row boundaries (None: every row is one token, row i's at i)."""
        fed = [i for i, row in enumerate(rows) if row.feed_from is not None]
        if not fed:
            return None
        if not isinstance(feed, _LaunchedStep) or feed.runner is not self:
            raise FeedError(
                f"row of {rows[fed[0]].request_id!r} is fed from {type(feed).__name__}, not from a step "
                "this runner launched"
            )
        # A fed row is one token: it is rewritten at its row's offset in the packed step.
        targets = fed if cu_seqlens is None else [cu_seqlens[i] for i in fed]
        sources = feed.sampled_indices([row.feed_from for row in rows if row.feed_from is not None])
        if -1 in sources:
            row = rows[fed[sources.index(-1)]]
            raise FeedError(
                f"row of {row.request_id!r}: feed_from={row.feed_from} names a row that sampled nothing"
            )
        assert feed.device_tokens is not None
        tokens = feed.device_tokens
        count = len(targets)
        if targets == sources and targets[-1] == count - 1:
            # Rows 0..count-1 each fed from the same row of `feed` (a decode step whose rows are the
            # last step's, in order: the common case): one slice copy, no index to stage and send.

            def rewrite_leading(input_ids: torch.Tensor) -> None:
                input_ids[:count].copy_(tokens[:count])

            return rewrite_leading
        index = staging.stage("feed", torch.from_numpy(np.array([targets, sources], dtype=np.int64)))
        target_index, source_index = index.to(self.model.device, non_blocking=True).unbind(0)

        def rewrite(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, target_index, tokens.index_select(0, source_index))

        return rewrite

    @torch.inference_mode()
    def launch_prefill(self, batch: StepBatch) -> PrefillHandle:
        """Implements `engine.runner.OverlappingRunner`: one eager forward over `batch` on the side
        stream, beside whatever the main stream runs until the handle is collected."""
        self._refuse_state_copies(batch, "overlapped prefill")
        rows = batch.rows
        attention = self._side_attention()
        if self.model.device.type != "cuda":
            logits = self._eager_logits(rows, attention)
            return ReadyPrefill(sample_rows(rows, logits, self.seeds, triton_draw=self.triton_draw))
        stream = self._side_stream()
        # Anything the main stream still has queued (nothing, after a step's sampling synced it)
        # comes first: the prefill may read prefix-cache pages earlier steps wrote.
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        try:
            with torch.cuda.stream(stream):
                logits = self._eager_logits(rows, attention)
                finished = torch.cuda.Event()
                finished.record(stream)
        except BaseException:
            # The contract: nothing this launch started is left running behind an exception.
            stream.synchronize()
            raise
        return _StreamedPrefill(rows, logits, finished, self.seeds, self.triton_draw)

    def _side_attention(self) -> AttentionBackend:
        if self._side_backend is None:
            self._side_backend = self.attention.sibling()
        return self._side_backend

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.model.device)
        return self._stream

    def _segmented_logits(self, rows: Sequence[BatchRow], bucket: int) -> torch.Tensor | None:
        """The prefill graphs' forward over what they loaded for `rows` (in `bucket`), then the
        logits of the rows that sample; None when none does."""
        assert self.prefill_graphs is not None
        sampled = sum(r.sample for r in rows)
        hidden = self.prefill_graphs.run(bucket, sampled, replay=self.replay_graphs)
        return self.model.logits(hidden) if sampled else None

    def _eager_logits(
        self,
        rows: Sequence[BatchRow],
        attention: AttentionBackend,
        table_cache: PageTableCache | None = None,
        *,
        mark_inputs: bool = False,
    ) -> torch.Tensor | None:
        """One forward over `rows` through `attention`; None when no row samples. `mark_inputs`:
        the main stream's step, whose input copies the next plan waits for (`_wait_for_inputs`)."""
        step = pack_step(rows, self.model.kv.attention_specs, attention, table_cache=table_cache)
        step = step.to(self.model.device)
        if mark_inputs:
            self._inputs_queued = _record_event(self.model.device.type == "cuda")
        hidden = self.model.forward(step)
        if not any(r.sample for r in rows):
            return None
        return self.model.logits(hidden)

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], page_table: Sequence[int]) -> torch.Tensor:
        """Float32 logits [len(token_ids), vocab] at every position of one sequence, computed by a
        single prefill into `page_table` (one table for every KV group). A diagnostic for parity
        gates: the caller owns those pages, so it must not run while the scheduler holds them."""
        self._wait_for_inputs()  # it plans too
        specs = self.model.kv.attention_specs
        row = BatchRow.whole_prompt("score", token_ids, (tuple(page_table),) * len(specs))
        step = pack_step([row], specs, self.attention, logits_last=len(row.token_ids))
        return self.model.logits(self.model.forward(step.to(self.model.device)))


def _record_event(on_cuda: bool) -> torch.cuda.Event | None:
    if not on_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class _LaunchedStep:
    """A step queued by `PagedModelRunner.launch_step`: its sampled ids on the device (what the next
    step's fed rows read) and on their way into pinned host buffers, complete at `finished`."""

    def __init__(
        self,
        runner: PagedModelRunner,
        rows: Sequence[BatchRow],
        device_tokens: torch.Tensor | None,
        host: SamplerOutput | None,
        logprobs_requested: tuple[int | None, ...],
        finished: torch.cuda.Event | None,
    ) -> None:
        self.runner = runner
        self.device_tokens = device_tokens
        self._samples = [r.sample for r in rows]
        # Row index -> index among the sampling rows (the sampler's row); -1 for a row that sampled
        # nothing. None when every row samples (a decode step): row i is the sampler's row i.
        self._sampled_at: list[int] | None = None
        if not all(self._samples):
            self._sampled_at = [
                sampled - 1 if samples else -1
                for samples, sampled in zip(self._samples, accumulate(self._samples), strict=True)
            ]
        self._host = host
        self._requested = logprobs_requested
        self._finished = finished

    def sampled_indices(self, rows: Sequence[int]) -> list[int]:
        """The sampler's row of each of these rows of the step; -1 for a row that sampled nothing
        or is not in the step."""
        at = self._sampled_at
        n = len(self._samples)
        if at is None:
            return [row if 0 <= row < n else -1 for row in rows]
        return [at[row] if 0 <= row < n else -1 for row in rows]

    def done(self) -> bool:
        return self._finished is None or bool(self._finished.query())

    def wait(self) -> None:
        if self._finished is not None:
            self._finished.synchronize()

    def collect(self) -> list[SampledToken | None]:
        self.wait()
        if self._host is None:
            return [None] * len(self._samples)
        # Host tensors (pinned, complete after the event): reading them waits for nothing.
        return _in_rows(self._host.to_sampled_tokens(self._requested), self._samples)


class _StreamedPrefill:
    """A prefill forward queued on the side stream; `finished` completes after its last kernel."""

    def __init__(
        self,
        rows: Sequence[BatchRow],
        logits: torch.Tensor | None,
        finished: torch.cuda.Event,
        seeds: SeedSource,
        triton_draw: bool,
    ) -> None:
        self._seeds = seeds
        self._triton_draw = triton_draw
        # Kept for sampling at collect: only ids, sampling params and counts are read then.
        self._rows = tuple(rows)
        self._logits = logits
        self._finished = finished

    def done(self) -> bool:
        return bool(self._finished.query())

    def collect(self) -> list[SampledToken | None]:
        self._finished.synchronize()
        logits, self._logits = self._logits, None
        if logits is not None:
            consumer = torch.cuda.current_stream(logits.device)
            # Already satisfied after synchronize; it records the dependency for the stream too.
            consumer.wait_event(self._finished)
            # Allocated on the side stream: without this its memory could be handed to a later side
            # allocation while the sampler (on the main stream) still reads it.
            logits.record_stream(consumer)
        with torch.inference_mode():
            return sample_rows(self._rows, logits, self._seeds, triton_draw=self._triton_draw)
