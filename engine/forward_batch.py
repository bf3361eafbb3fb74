"""The model side of a step: the device inputs one forward reads (built by engine.step_packer), and
the protocol a paged causal LM implements so the generic runner and the CUDA-graph decoder can
drive it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv.pools import KVPools
from kernels.attention.base import AttentionBackend
from kernels.reference import PagedRows


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One step's inputs (engine.step_packer builds them on the host; `to` moves them). `rows[g]`
    says where each token's KV lives in group g: every group shares `positions` and the rows'
    sequence index, only page tables differ. `sample_index` picks the tokens whose logits are
    needed."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    rows: tuple[PagedRows, ...]
    sample_index: torch.Tensor
    attention: AttentionBackend
    # int64 [rows]: each row's state slot (engine/kv/state_pool.py), filler rows slot 0.
    state_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> ForwardBatch:
        def moved(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        positions, seq_index = moved(self.positions), moved(self.rows[0].seq_index)
        return ForwardBatch(
            input_ids=moved(self.input_ids),
            positions=positions,
            rows=tuple(PagedRows(positions, seq_index, moved(r.page_table)) for r in self.rows),
            sample_index=moved(self.sample_index),
            attention=self.attention,
            state_slots=None if self.state_slots is None else moved(self.state_slots),
        )


@dataclass(frozen=True, slots=True)
class RooflineFacts:
    """What one forward must move and compute, for benchmarks' floors.

    A decode step reads every matmul weight once (`weight_bytes`) plus each row's KV; a prefill of
    L tokens does 2·matmul_params·L flops in projections plus attention, whose score and value
    products cost `attention_flops_per_pair` for each (query, visible key) pair."""

    weight_bytes: int
    matmul_params: int
    kv_bytes_per_token: int
    attention_flops_per_pair: int


class PagedCausalLM(Protocol):
    device: torch.device
    # The model's KV groups, declared once, and their device pools (sized by start-up).
    kv: KVPools

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of the tokens at `batch.sample_index`: [len(sample_index), hidden]."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] in float32."""
        ...

    def roofline(self) -> RooflineFacts: ...
