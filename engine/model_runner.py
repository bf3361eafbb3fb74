"""PagedModelRunner: turns a scheduler's `StepBatch` into one forward of a paged causal LM.

It owns the step's tensors (token ids, positions, each KV group's page table), plans the attention
backend for every KV group, asks the model for the hidden states of the rows that sample, and
samples on the model's device. The model owns its weights and KV pools; the runner owns no policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.contract import SamplingParams
from engine.cuda_graphs import GraphedDecode
from engine.forward_batch import ForwardBatch, PagedCausalLM
from engine.runner import BatchRow, SampledToken, StepBatch
from engine.sampling import sample
from engine.sampling_batch import RowSampling, SamplingBatch, SeedSource
from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch
from kernels.reference import PagedRows


def build_forward_batch(
    rows: Sequence[BatchRow],
    page_size: int,
    specs: Sequence[AttentionLayerSpec],
    device: torch.device,
    attention: AttentionBackend,
) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    seq_index: list[int] = []
    sample_index: list[int] = []
    for i, row in enumerate(rows):
        input_ids.extend(row.token_ids)
        positions.extend(range(row.start_pos, row.end_pos))
        seq_index.extend([i] * len(row.token_ids))
        if row.sample:
            sample_index.append(len(input_ids) - 1)

    def on_device(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    positions_t = on_device(positions, torch.int32)
    seq_index_t = on_device(seq_index, torch.int32)
    paged: list[PagedRows] = []
    for g, spec in enumerate(specs):
        tables = tuple(r.page_tables[g] for r in rows)
        width = max(len(t) for t in tables)
        padded = [list(t) + [0] * (width - len(t)) for t in tables]
        paged.append(PagedRows(positions_t, seq_index_t, on_device(padded, torch.int32)))
        attention.plan(
            g,
            GroupBatch(
                q_lens=tuple(len(r.token_ids) for r in rows),
                kv_lens=tuple(r.end_pos for r in rows),
                page_tables=tables,
                page_size=page_size,
            ),
            spec,
        )
    return ForwardBatch(
        input_ids=on_device(input_ids, torch.long),
        positions=positions_t,
        rows=tuple(paged),
        sample_index=on_device(sample_index, torch.long),
        attention=attention,
    )


class PagedModelRunner:
    """Runs any `PagedCausalLM`: decode-only steps through captured CUDA graphs when it has them,
    everything else eagerly. Implements `engine.runner.ModelRunner`."""

    def __init__(
        self,
        model: PagedCausalLM,
        attention: AttentionBackend,
        seeds: SeedSource | None = None,
        graphs: GraphedDecode | None = None,
    ) -> None:
        self.model = model
        self.attention = attention
        self.seeds = seeds or SeedSource()
        self.graphs = graphs
        # False: graphed steps run their padded buffers eagerly (the graph gate's comparison).
        self.replay_graphs = True

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        rows = batch.rows
        results: list[SampledToken | None] = [None] * len(rows)
        if self.graphs is not None and self.graphs.accepts(rows):
            logits = self.graphs.logits(rows, replay=self.replay_graphs)
        else:
            fb = build_forward_batch(
                rows, self.model.page_size, self.model.attention_specs, self.model.device, self.attention
            )
            hidden = self.model.forward(fb)
            if not any(r.sample for r in rows):
                return results
            logits = self.model.logits(hidden)
        sampling_rows = [r for r in rows if r.sample]
        params = SamplingBatch.pack([RowSampling.of(r, self.seeds) for r in sampling_rows])
        picked = sample(logits, params.to(logits.device), params.plan)
        sampled = iter(picked.to_sampled_tokens(params.logprobs_requested))
        for i, row in enumerate(rows):
            if row.sample:
                results[i] = next(sampled)
        return results

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], page_table: Sequence[int]) -> torch.Tensor:
        """Float32 logits [len(token_ids), vocab] at every position of one sequence, computed by a
        single prefill into `page_table` (one table for every KV group). A diagnostic for parity
        gates: the caller owns those pages, so it must not run while the scheduler holds them."""
        row = BatchRow(
            request_id="score",
            token_ids=tuple(token_ids),
            start_pos=0,
            page_tables=(tuple(page_table),) * len(self.model.attention_specs),
            sample=True,
            sampling=SamplingParams(),
            context=list(token_ids),
            num_generated=0,
        )
        fb = build_forward_batch(
            [row], self.model.page_size, self.model.attention_specs, self.model.device, self.attention
        )
        fb.sample_index = torch.arange(len(token_ids), device=self.model.device)
        return self.model.logits(self.model.forward(fb))
