"""The `triton` attention backend: decode steps through the split-KV Triton kernel, everything else
through an inner backend.

A step whose every sequence has one query token, on a layer geometry the kernel takes (head dims
64/128/256, kernels/triton/decode_attention.py), of at most `kernel_rows` rows, runs
`decode_attention` with P·V in the storage dtype (`PV_STORAGE`), at the split size
`SPLIT_TOKENS_BY_ROWS` names for its rows where `kernel_rows` is set (the kernel's default
otherwise, and for every step under the invariant policies). Any step
holding a prefill chunk, any larger decode step, and any geometry the kernel refuses (Gemma 4's
head-dim-512 global layers), is planned and run by the inner backend: FlashInfer on CUDA, the torch
reference backend where FlashInfer is absent (so CPU tests drive this backend under the Triton
interpreter). `kernel_rows` None: every decode step, as the end-to-end invariant policies need (a
row's kernel must not follow the batch); models/device_choice.py sets `KERNEL_ROWS` for the others,
the batches where the kernel measured faster than FlashInfer.

CUDA graphs: each (group, bucket) gets a page table `[bucket, max_pages_per_seq]` and a KV-length
vector `[bucket]`, int32, allocated at its first graph plan and rewritten in place by every later
plan (a stream-ordered copy, so a step still running on the old contents finishes first). The
kernel's grid depends on the bucket and the geometry only, so the captured launch replays against
the new step. Steps the inner backend serves in a bucket use its own graph buffers.

Scratch: the kernel's fp32 partials, `DecodeGeometry.scratch_bytes_per_row` per row (266,240 B for
Qwen3-4B), one buffer per geometry for the most rows the kernel serves: `max_rows` (the engine's
`max_num_seqs`: 68 MB for Qwen3-4B at 256) where `kernel_rows` is None, else the smaller of
`max_rows` and `kernel_rows` (4.3 MB for Qwen3-4B at 16). It is allocated at the geometry's first
plan and never moved. Every layer, group, bucket and eager step of this instance shares it: they
run one after another on one stream, and a scratch is dead between a merge launch and the next
split launch. An eager kernel step past it gets a scratch of its own for that step; a graph bucket
past it that the kernel would serve is refused. `sibling()` gets its own.

Batch invariance: decode rows are batch-invariant by construction (the kernel's docstring);
`batch_invariant` on the inner backend covers the prefill steps. A decode row that shares a step
with a prefill chunk goes through the inner backend, so its bits depend on whether a prefill rode
along (as with FlashInfer alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch, WarmUpStep
from kernels.kv_layout import PADDING_PAGE, ceil_div
from kernels.triton.decode_attention import (
    SPLIT_TOKENS,
    DecodeGeometry,
    DecodeScratch,
    decode_attention,
    supports,
)

# Decode steps up to this many rows run the kernel where the policy lets the kernel follow the
# batch: on an H100 (2026-12-07, 38b9790, Qwen3-4B at 512-token contexts, two runs each,
# docs/benchmarks/qwen3.md) with P·V in bf16 the decode step took 4.130 / 4.134 ms against
# FlashInfer's 4.168 / 4.153 at batch 8 and 4.435 / 4.444 against 4.491 / 4.476 at batch 16, but
# 6.420 / 6.405 against 6.181 / 6.183 at batch 64 (FlashInfer faster).
KERNEL_ROWS = 16
# Where the policy lets the kernel follow the batch: (most rows, tokens per split), ascending; a step
# of more rows than every entry names, or any step under an end-to-end invariant policy, splits at
# `decode_attention.SPLIT_TOKENS`. Empty: no measurement has yet preferred another size
# (docs/benchmarks/scripts/decode_attention_backends.py --triton-splits times them).
SPLIT_TOKENS_BY_ROWS: tuple[tuple[int, int], ...] = ()
# The kernel's P·V dot takes P rounded to the storage dtype (`pv_storage`: FlashInfer's numerics,
# about half the split kernel's registers). On an H100 (2026-12-07, 38b9790, same runs) the decode
# step took 3.375 / 3.376 ms against 3.409 / 3.409 with the tf32x3 dot at batch 1, 3.786 / 3.777
# against 3.806 / 3.794 at 2 and 3.950 / 3.960 against 4.027 / 4.025 at 4; with the tf32x3 dot the
# kernel lost to FlashInfer at 8 and 16 (4.199 / 4.229 and 4.576 / 4.564 ms).
PV_STORAGE = True


@dataclass(frozen=True, slots=True)
class _GraphBuffers:
    page_table: torch.Tensor  # int32 [bucket, max_pages_per_seq]
    kv_lens: torch.Tensor  # int32 [bucket]


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    page_table: torch.Tensor
    kv_lens: torch.Tensor
    scratch: DecodeScratch
    split_tokens: int


class TritonDecodeAttention(AttentionBackend):
    name = "triton"
    supports_graphs = True

    def __init__(
        self,
        inner: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        max_pages_per_seq: int,
        max_rows: int,
        kernel_rows: int | None = None,
    ) -> None:
        if max_rows < 1 or max_pages_per_seq < 1 or (kernel_rows is not None and kernel_rows < 1):
            raise ValueError(
                f"max_rows={max_rows}, max_pages_per_seq={max_pages_per_seq} and kernel_rows={kernel_rows} "
                "must be positive"
            )
        self.inner = inner
        self.device = device
        self.dtype = dtype
        self.max_pages_per_seq = max_pages_per_seq
        self.max_rows = max_rows
        self.kernel_rows = kernel_rows
        self._graph_buffers: dict[tuple[int, int], _GraphBuffers] = {}  # (group, bucket)
        self._scratch: dict[DecodeGeometry, DecodeScratch] = {}
        # Per group: this step's decode plan, or None where the inner backend holds the plan.
        self._active: dict[int, _DecodePlan | None] = {}
        # Group plans served by the kernel and by the inner backend (what tests and stats read).
        self.decode_plans = 0
        self.inner_plans = 0

    def plan(
        self, group: int, batch: GroupBatch, layer: AttentionLayerSpec, graph_bucket: int | None = None
    ) -> None:
        rows = len(batch.q_lens)
        decode = all(q == 1 for q in batch.q_lens)
        if not (decode and supports(layer) and (self.kernel_rows is None or rows <= self.kernel_rows)):
            if graph_bucket is not None and not self.inner.supports_graphs:
                raise ValueError(
                    f"attention backend {self.name!r}: a graph plan of {layer} needs the inner backend "
                    f"{self.inner.name!r}, which cannot be captured in a CUDA graph"
                )
            self.inner.plan(group, batch, layer, graph_bucket)
            self._active[group] = None
            self.inner_plans += 1
            return
        if graph_bucket is not None and rows != graph_bucket:
            raise ValueError(f"a graph plan needs a decode step of exactly {graph_bucket} rows, got {rows}")
        pages = [ceil_div(kv, batch.page_size) for kv in batch.kv_lens]
        width = max(pages)
        # Only the pages holding a row's positions: entries past them are never read.
        table = np.full((rows, width), PADDING_PAGE, dtype=np.int32)
        for i, (entries, n) in enumerate(zip(batch.page_tables, pages, strict=True)):
            table[i, :n] = entries[:n]
        host_table = torch.from_numpy(table)
        host_lens = torch.tensor(batch.kv_lens, dtype=torch.int32)
        if graph_bucket is None:
            page_table = host_table.to(self.device, non_blocking=True)
            kv_lens = host_lens.to(self.device, non_blocking=True)
        else:
            if width > self.max_pages_per_seq:
                raise ValueError(
                    f"a graph plan of {width} pages per row exceeds max_pages_per_seq={self.max_pages_per_seq}"
                )
            buffers = self._graph_buffers_for(group, graph_bucket)
            buffers.page_table[:, :width].copy_(host_table, non_blocking=True)
            buffers.kv_lens.copy_(host_lens, non_blocking=True)
            page_table, kv_lens = buffers.page_table, buffers.kv_lens
        scratch = self._scratch_for(DecodeGeometry.of(layer), rows, graphed=graph_bucket is not None)
        self._active[group] = _DecodePlan(page_table, kv_lens, scratch, self.split_tokens(rows))
        self.decode_plans += 1

    def split_tokens(self, rows: int) -> int:
        """Tokens per split for a decode step of `rows` rows: `SPLIT_TOKENS_BY_ROWS` where the
        kernel may follow the batch (`kernel_rows` set), else the kernel's fixed default."""
        if self.kernel_rows is not None:
            for most_rows, split in SPLIT_TOKENS_BY_ROWS:
                if rows <= most_rows:
                    return split
        return SPLIT_TOKENS

    def _graph_buffers_for(self, group: int, bucket: int) -> _GraphBuffers:
        key = (group, bucket)
        if key not in self._graph_buffers:
            self._graph_buffers[key] = _GraphBuffers(
                torch.full(
                    (bucket, self.max_pages_per_seq), PADDING_PAGE, dtype=torch.int32, device=self.device
                ),
                torch.ones(bucket, dtype=torch.int32, device=self.device),
            )
        return self._graph_buffers[key]

    def _scratch_for(self, geometry: DecodeGeometry, rows: int, *, graphed: bool) -> DecodeScratch:
        scratch = self._scratch.get(geometry)
        if scratch is None:
            # The kernel serves no step past `kernel_rows` rows: the rest go to the inner backend.
            served = self.max_rows if self.kernel_rows is None else min(self.max_rows, self.kernel_rows)
            scratch = DecodeScratch.allocate(geometry, max(rows, served), self.device)
            self._scratch[geometry] = scratch
        if scratch.rows >= rows:
            return scratch
        if graphed:
            # A captured graph may hold the shared scratch's address: it can never move.
            raise ValueError(f"a graph bucket of {rows} rows exceeds max_rows={scratch.rows}")
        return DecodeScratch.allocate(geometry, rows, self.device)  # this eager step only

    def run(
        self, group: int, layer: AttentionLayerSpec, q: torch.Tensor, pool_layer: torch.Tensor
    ) -> torch.Tensor:
        plan = self._active[group]
        if plan is None:
            return self.inner.run(group, layer, q, pool_layer)
        return decode_attention(
            q,
            pool_layer,
            plan.page_table,
            plan.kv_lens,
            layer,
            scratch=plan.scratch,
            split_tokens=plan.split_tokens,
            pv_storage=PV_STORAGE,
        )

    def sibling(self) -> TritonDecodeAttention:
        # Its own buffers, scratch and inner backend: a concurrent forward shares no memory with us.
        return TritonDecodeAttention(
            self.inner.sibling(),
            self.device,
            self.dtype,
            self.max_pages_per_seq,
            self.max_rows,
            self.kernel_rows,
        )

    def warm_up_steps(self, specs: Sequence[AttentionLayerSpec], page_size: int) -> list[WarmUpStep]:
        """The inner backend's steps (prefill, and what it compiles for decode), then one step per
        geometry and window kind this kernel serves: a one-row decode on scratch tensors, which
        makes Triton build both kernels as the serving steps specialise them."""
        steps = list(self.inner.warm_up_steps(specs, page_size))
        seen: set[tuple[DecodeGeometry, bool]] = set()
        for spec in specs:
            key = (DecodeGeometry.of(spec), spec.window is not None)
            if not supports(spec) or key in seen:
                continue
            seen.add(key)
            shape = f"{spec.num_heads}/{spec.num_kv_heads} heads, head dim {spec.head_dim}" + (
                f", window {spec.window}" if spec.window is not None else ""
            )
            steps.append(WarmUpStep(f"triton decode · {shape}", partial(self._warm, spec, page_size)))
        return steps

    def _warm(self, spec: AttentionLayerSpec, page_size: int) -> None:
        pool = torch.zeros(
            2, 2, page_size, spec.num_kv_heads, spec.head_dim, dtype=self.dtype, device=self.device
        )
        q = torch.zeros(1, spec.num_heads, spec.head_dim, dtype=self.dtype, device=self.device)
        table = torch.ones(1, 1, dtype=torch.int32, device=self.device)
        kv_lens = torch.full((1,), 2, dtype=torch.int32, device=self.device)
        # Every split size a kernel step may take (each is its own compiled kernel), before any capture.
        splits = {self.split_tokens(rows) for rows in range(1, (self.kernel_rows or 1) + 1)}
        for split in sorted(splits):
            decode_attention(q, pool, table, kv_lens, spec, split_tokens=split, pv_storage=PV_STORAGE)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
