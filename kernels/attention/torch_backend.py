"""The reference attention backend: gathers each sequence's pages and attends in fp32.

It runs the spec (`kernels.reference.paged_kv` and `attend_one_sequence`) one sequence at a time.

Runs on CPU and GPU. It is the semantics every fast backend is compared with, not a fast path.

Batch-invariant under every numeric policy: `run` attends one sequence at a time, and every op for
a sequence (its gather, the two matmuls, the softmax) sees only that sequence's rows, with shapes
set by its own query and KV lengths. Nothing another request brings to the step changes which
kernels run on a row or the order they reduce in.
"""

from __future__ import annotations

import torch

from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch
from kernels.reference import attend_one_sequence, paged_kv


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._plans: dict[int, GroupBatch] = {}

    def plan(
        self, group: int, batch: GroupBatch, layer: AttentionLayerSpec, graph_bucket: int | None = None
    ) -> None:
        if graph_bucket is not None:
            raise NotImplementedError("the torch attention backend cannot be captured in a CUDA graph")
        self._plans[group] = batch

    def sibling(self) -> TorchAttention:
        return TorchAttention()

    def run(
        self, group: int, layer: AttentionLayerSpec, q: torch.Tensor, pool_layer: torch.Tensor
    ) -> torch.Tensor:
        batch = self._plans[group]
        out = torch.empty_like(q)
        row = 0
        for q_len, kv_len, table in zip(batch.q_lens, batch.kv_lens, batch.page_tables, strict=True):
            k, v = paged_kv(pool_layer, table, kv_len, layer.num_kv_heads, layer.head_dim)
            out[row : row + q_len] = attend_one_sequence(q[row : row + q_len], k, v, layer)
            row += q_len
        return out
