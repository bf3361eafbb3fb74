"""PagedModelRunner: one forward of a paged causal LM per `StepBatch`, then sampling on its device.

Rows become tensors in engine.step_packer; decode-only steps that fit a bucket replay a captured
graph (engine.cuda_graphs). The model owns its weights and KV pools; the runner owns no policy.
Overlapped prefill runs its forward on a side CUDA stream with its own attention instance
(`AttentionBackend.sibling`) and hands only the logits to the main stream (docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cuda_graphs import GraphedDecode
from engine.forward_batch import PagedCausalLM
from engine.runner import BatchRow, PrefillHandle, ReadyPrefill, SampledToken, StepBatch
from engine.sampling import sample
from engine.sampling_batch import RowSampling, SamplingBatch, SeedSource
from engine.step_packer import pack_step
from kernels.attention.base import AttentionBackend


def sample_rows(
    rows: Sequence[BatchRow], logits: torch.Tensor | None, seeds: SeedSource
) -> list[SampledToken | None]:
    """Sample the rows with `sample` from `logits` (one row each, in order); None for the others."""
    results: list[SampledToken | None] = [None] * len(rows)
    if logits is None:
        return results
    params = SamplingBatch.pack([RowSampling.of(r, seeds) for r in rows if r.sample])
    picked = sample(logits, params.to(logits.device), params.plan)
    sampled = iter(picked.to_sampled_tokens(params.logprobs_requested))
    for i, row in enumerate(rows):
        if row.sample:
            results[i] = next(sampled)
    return results


class PagedModelRunner:
    """Runs any `PagedCausalLM`: decode-only steps through captured CUDA graphs when it has them,
    everything else eagerly. Implements `engine.runner.ModelRunner`."""

    def __init__(
        self,
        model: PagedCausalLM,
        attention: AttentionBackend,
        seeds: SeedSource | None = None,
        graphs: GraphedDecode | None = None,
        side_attention: AttentionBackend | None = None,
    ) -> None:
        self.model = model
        self.attention = attention
        self.seeds = seeds or SeedSource()
        self.graphs = graphs
        # False: graphed steps run their padded buffers eagerly (the graph gate's comparison).
        self.replay_graphs = True
        # Overlapped prefill's stream and attention instance. Start-up passes the instance in when
        # --async-prefill is on, so its workspace is counted before the KV pool is sized; otherwise
        # it is made on the first launch.
        self._stream: torch.cuda.Stream | None = None
        self._side_backend: AttentionBackend | None = side_attention

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        rows = batch.rows
        graphs = self.graphs
        if graphs is not None and graphs.accepts(rows):
            step = pack_step(
                rows, self.model.kv.attention_specs, self.attention, bucket=graphs.bucket_for(len(rows))
            )
            logits: torch.Tensor | None = graphs.logits(step, len(rows), replay=self.replay_graphs)
        else:
            logits = self._eager_logits(rows, self.attention)
        return sample_rows(rows, logits, self.seeds)

    @torch.inference_mode()
    def launch_prefill(self, batch: StepBatch) -> PrefillHandle:
        """Implements `engine.runner.OverlappingRunner`: one eager forward over `batch` on the side
        stream, beside whatever the main stream runs until the handle is collected."""
        rows = batch.rows
        attention = self._side_attention()
        if self.model.device.type != "cuda":
            return ReadyPrefill(sample_rows(rows, self._eager_logits(rows, attention), self.seeds))
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
        return _StreamedPrefill(rows, logits, finished, self.seeds)

    def _side_attention(self) -> AttentionBackend:
        if self._side_backend is None:
            self._side_backend = self.attention.sibling()
        return self._side_backend

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.model.device)
        return self._stream

    def _eager_logits(self, rows: Sequence[BatchRow], attention: AttentionBackend) -> torch.Tensor | None:
        """One forward over `rows` through `attention`; None when no row samples."""
        step = pack_step(rows, self.model.kv.attention_specs, attention)
        hidden = self.model.forward(step.to(self.model.device))
        if not any(r.sample for r in rows):
            return None
        return self.model.logits(hidden)

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], page_table: Sequence[int]) -> torch.Tensor:
        """Float32 logits [len(token_ids), vocab] at every position of one sequence, computed by a
        single prefill into `page_table` (one table for every KV group). A diagnostic for parity
        gates: the caller owns those pages, so it must not run while the scheduler holds them."""
        specs = self.model.kv.attention_specs
        row = BatchRow.whole_prompt("score", token_ids, (tuple(page_table),) * len(specs))
        step = pack_step([row], specs, self.attention, logits_last=len(row.token_ids))
        return self.model.logits(self.model.forward(step.to(self.model.device)))


class _StreamedPrefill:
    """A prefill forward queued on the side stream; `finished` completes after its last kernel."""

    def __init__(
        self,
        rows: Sequence[BatchRow],
        logits: torch.Tensor | None,
        finished: torch.cuda.Event,
        seeds: SeedSource,
    ) -> None:
        self._seeds = seeds
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
            return sample_rows(self._rows, logits, self._seeds)
