"""The reference attention backend: gathers each sequence's pages and attends in fp32.

Runs on CPU and GPU. It is the semantics every fast backend is compared with, not a fast path.

Batch-invariant under every numeric policy: `run` attends one sequence at a time, and every op for
a sequence (its gather, the two matmuls, the softmax) sees only that sequence's rows, with shapes
set by its own query and KV lengths. Nothing another request brings to the step changes which
kernels run on a row or the order they reduce in.
"""

from __future__ import annotations

import torch

from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch
from kernels.kv_layout import ceil_div


def attend_one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec
) -> torch.Tensor:
    """q: [n, H, D] for the last n of the kv_len positions held in k, v: [kv_len, Hkv, D]."""
    n, kv_len = q.shape[0], k.shape[0]
    kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
    group = layer.num_heads // kv_heads
    # Query head h reads KV head h // group. Folding a KV head's `group` query heads into its rows
    # ([Hkv, group·n, D]) attends them against K and V as stored, never a repeated copy.
    qf = (
        q.float()
        .reshape(n, kv_heads, group, head_dim)
        .permute(1, 2, 0, 3)
        .reshape(kv_heads, group * n, head_dim)
    )
    kf = k.float().transpose(0, 1)  # [Hkv, kv, D]
    vf = v.float().transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * layer.scale  # [Hkv, group·n, kv]
    q_pos = torch.arange(kv_len - n, kv_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=q.device).unsqueeze(0)
    visible = k_pos <= q_pos
    if layer.window is not None:
        visible &= k_pos > q_pos - layer.window
    scores = scores.view(kv_heads, group, n, kv_len).masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf.unsqueeze(1))  # [Hkv, group, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, layer.num_heads, head_dim).to(q.dtype)


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
            pages = torch.tensor(
                table[: ceil_div(kv_len, batch.page_size)], device=q.device, dtype=torch.long
            )
            kv = pool_layer.index_select(0, pages)  # [p, 2, page_size, Hkv, D]
            k = kv[:, 0].reshape(-1, layer.num_kv_heads, layer.head_dim)[:kv_len]
            v = kv[:, 1].reshape(-1, layer.num_kv_heads, layer.head_dim)[:kv_len]
            out[row : row + q_len] = attend_one_sequence(q[row : row + q_len], k, v, layer)
            row += q_len
        return out
