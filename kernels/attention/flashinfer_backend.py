"""FlashInfer attention over the paged pool: the GPU backend.

Steps whose every sequence has one query token use FlashInfer's paged decode kernel; any step
holding a prefill chunk uses its paged prefill kernel with a causal mask (decode rows ride along as
one-token queries). Sliding layers pass `window_left = window - 1`: FlashInfer's window counts the
positions before the query, ours includes the query itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch

WORKSPACE_BYTES = 256 << 20


@dataclass(slots=True)
class _GroupPlan:
    wrapper: Any


def _indptr(lengths: list[int], device: torch.device) -> torch.Tensor:
    values = [0]
    for n in lengths:
        values.append(values[-1] + n)
    return torch.tensor(values, dtype=torch.int32, device=device)


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        import flashinfer

        self._fi = flashinfer
        self.device = device
        self.dtype = dtype
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill: dict[int, Any] = {}
        self._decode: dict[int, Any] = {}
        self._plans: dict[int, _GroupPlan] = {}

    def _wrappers(self, group: int) -> tuple[Any, Any]:
        if group not in self._prefill:
            self._prefill[group] = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            self._decode[group] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=True
            )
        return self._prefill[group], self._decode[group]

    def plan(self, group: int, batch: GroupBatch, layer: AttentionLayerSpec) -> None:
        ps = batch.page_size
        pages_per_seq = [-(-kv // ps) for kv in batch.kv_lens]
        indices = [p for table, n in zip(batch.page_tables, pages_per_seq, strict=True) for p in table[:n]]
        kv_indptr = _indptr(pages_per_seq, self.device)
        kv_indices = torch.tensor(indices, dtype=torch.int32, device=self.device)
        last_page_len = torch.tensor(
            [kv - (n - 1) * ps for kv, n in zip(batch.kv_lens, pages_per_seq, strict=True)],
            dtype=torch.int32,
            device=self.device,
        )
        window_left = -1 if layer.window is None else layer.window - 1
        prefill, decode = self._wrappers(group)
        if all(q == 1 for q in batch.q_lens):
            decode.plan(
                kv_indptr,
                kv_indices,
                last_page_len,
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_dim,
                ps,
                window_left=window_left,
                sm_scale=layer.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
            self._plans[group] = _GroupPlan(decode)
        else:
            prefill.plan(
                _indptr(list(batch.q_lens), self.device),
                kv_indptr,
                kv_indices,
                last_page_len,
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_dim,
                ps,
                causal=True,
                sm_scale=layer.scale,
                window_left=window_left,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
            self._plans[group] = _GroupPlan(prefill)

    def run(
        self, group: int, layer: AttentionLayerSpec, q: torch.Tensor, pool_layer: torch.Tensor
    ) -> torch.Tensor:
        out: torch.Tensor = self._plans[group].wrapper.run(q.contiguous(), pool_layer)
        return out
