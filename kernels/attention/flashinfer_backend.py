"""FlashInfer attention over the paged pool: the GPU backend.

Steps whose every sequence has one query token use FlashInfer's paged decode kernel; any step
holding a prefill chunk uses its paged prefill kernel with a causal mask (decode rows ride along as
one-token queries). Sliding layers pass `window_left = window - 1`: FlashInfer's window counts the
positions before the query, ours includes the query itself.

CUDA graphs: each (group, bucket) gets its own decode wrapper in FlashInfer's graph mode, whose
index buffers are allocated once at the bucket's size; planning a padded decode step rewrites
those buffers in place, so a graph captured over `run` replays against the new step.

`batch_invariant=True` (the `invariant` and `per-token` numeric policies) plans every step with
`disable_split_kv=True`. Otherwise FlashInfer's planner splits a long KV across CTAs when the batch
is small and merges the partial softmaxes, and whether and where it splits depends on the batch
size and every other row's length: a row's reduction order, hence its bits, follows its neighbours.
Without the split each (request, query tile, KV head) is reduced by one CTA walking the KV in
order. FlashInfer's other control, `fixed_split_size` (split every request at a fixed number of
pages, batch-invariant too), is documented as not safe under CUDA graphs, where the CTA count
would follow the KV lengths of the captured step; one setting for eager and graphed steps also
keeps a decode row's bits the same on both paths. The price is parallelism at small batches over
long contexts (docs/numerics.md). Not covered: a decode row that rides in a mixed step goes
through the prefill kernel, so its bits depend on whether a prefill chunk shared its step.

Graph-mode decode plans (`tuned`, `pin`) also switch the split off once a bucket's rows times the
layer's KV heads fill the device's SMs. FlashInfer's graph-mode planner splits every step, however
large (`PrefillBinarySearchKVChunkSize` returns split = true whenever CUDA graphs are on, so that one
captured grid serves every replay), and the merge kernel then runs every layer; its eager planner
splits only a batch too small to fill the GPU, which this rule approximates at one work item per
SM. The rule reads the bucket and the layer's geometry only, so a bucket's capture and its replays
plan alike. The A/B that set it (Qwen3-4B: the split costs batch 64 0.18 ms and saves batch 1
0.07) is in docs/benchmarks/qwen3.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from itertools import chain
from typing import Any

import numpy as np
import torch

from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch, WarmUpStep
from kernels.kv_layout import KVPoolLayout, ceil_div
from kernels.triton.storage import multiprocessors

WORKSPACE_BYTES = 256 << 20


# A FlashInfer wrapper resolves backend="auto" at its first plan and keeps that backend for every
# later plan; its Hopper kernels (fa3) stop at head dim 256 (a static_assert at JIT time). So a
# wrapper never serves two head dims (they are keyed by group and head dim: the start-up warm-up
# plans every geometry on one scratch group, and a wrapper resolved to fa3 at head dim 256 then
# failed to build at 512 on the H200), and head dims past 256 ask for fa2 outright.
FA3_MAX_HEAD_DIM = 256


def tensor_core_backend(head_dim: int) -> str:
    """FlashInfer's own choice where fa3 can compile the head dim, fa2 above that."""
    return "auto" if head_dim <= FA3_MAX_HEAD_DIM else "fa2"


def _sm_count(device: torch.device) -> int:
    """The device's SM count; 0 off CUDA (the planner's stand-in tests), where FlashInfer's split stays."""
    return multiprocessors(device) if device.type == "cuda" else 0


def _indptr(lengths: list[int]) -> torch.Tensor:
    values = [0]
    for n in lengths:
        values.append(values[-1] + n)
    return torch.tensor(values, dtype=torch.int32)


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    supports_graphs = True

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        max_pages_per_seq: int,
        *,
        batch_invariant: bool = False,
    ) -> None:
        import flashinfer

        self._fi = flashinfer
        self.batch_invariant = batch_invariant
        self.device = device
        self.dtype = dtype
        self.max_pages_per_seq = max_pages_per_seq
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill: dict[tuple[int, int], Any] = {}  # (group, head dim)
        self._decode: dict[tuple[int, int], Any] = {}
        self._graph_decode: dict[tuple[int, int, int], Any] = {}  # (group, head dim, bucket)
        self._active: dict[int, Any] = {}
        self._indices = _DeviceIndices(device)

    def _eager_wrappers(self, group: int, head_dim: int) -> tuple[Any, Any]:
        key = (group, head_dim)
        if key not in self._prefill:
            self._prefill[key] = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", backend=tensor_core_backend(head_dim)
            )
            self._decode[key] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=True, backend=tensor_core_backend(head_dim)
            )
        return self._prefill[key], self._decode[key]

    def _graph_wrapper(self, group: int, bucket: int, head_dim: int) -> Any:
        key = (group, head_dim, bucket)
        if key not in self._graph_decode:
            self._graph_decode[key] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                backend=tensor_core_backend(head_dim),
                paged_kv_indptr_buffer=torch.zeros(bucket + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(
                    bucket * self.max_pages_per_seq, dtype=torch.int32, device=self.device
                ),
                paged_kv_last_page_len_buffer=torch.zeros(bucket, dtype=torch.int32, device=self.device),
            )
        return self._graph_decode[key]

    def plan(
        self, group: int, batch: GroupBatch, layer: AttentionLayerSpec, graph_bucket: int | None = None
    ) -> None:
        ps = batch.page_size
        pages_per_seq = [ceil_div(kv, ps) for kv in batch.kv_lens]
        kv_indptr = _indptr(pages_per_seq)
        # Each row's first n pages, concatenated; chain.from_iterable walks them in C (42 against
        # 70 µs for a nested generator at 64 rows of 33 pages, on the 2-core CPU box, 2026-12-05).
        kv_indices = self._indices.put(
            group,
            np.fromiter(
                chain.from_iterable(
                    table[:n] for table, n in zip(batch.page_tables, pages_per_seq, strict=True)
                ),
                dtype=np.int32,
                count=int(kv_indptr[-1]),
            ),
        )
        last_page_len = torch.tensor(
            [kv - (n - 1) * ps for kv, n in zip(batch.kv_lens, pages_per_seq, strict=True)], dtype=torch.int32
        )
        window_left = -1 if layer.window is None else layer.window - 1
        decode_only = all(q == 1 for q in batch.q_lens)
        if graph_bucket is not None:
            if not decode_only or len(batch.q_lens) != graph_bucket:
                raise ValueError(f"a graph plan needs a decode step of exactly {graph_bucket} rows")
            wrapper = self._graph_wrapper(group, graph_bucket, layer.head_dim)
        else:
            wrapper = self._eager_wrappers(group, layer.head_dim)[1 if decode_only else 0]
        # Decode and prefill planners take the same paged-KV arguments; prefill also takes the
        # query offsets first and the causal mask. The offsets and last-page lengths stay on the
        # host: the planners read them there (a device tensor would cost a copy each way, and a
        # sync) and copy them on. The page indices arrive on the device (`_DeviceIndices`).
        paged = (
            kv_indptr,
            kv_indices,
            last_page_len,
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
            ps,
        )
        options: dict[str, Any] = dict(
            sm_scale=layer.scale,
            window_left=window_left,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            **self.split_kwargs(layer, graph_bucket),
        )
        if decode_only:
            wrapper.plan(*paged, **options)
        else:
            wrapper.plan(_indptr(list(batch.q_lens)), *paged, causal=True, **options)
        self._active[group] = wrapper

    def split_kwargs(self, layer: AttentionLayerSpec, graph_bucket: int | None = None) -> dict[str, bool]:
        """The KV-split arguments a plan passes: the split off when batch-invariant, or for a graph
        bucket whose rows × KV heads fill the SMs (module doc); otherwise none (the planner decides).
        FlashInfer reads them on its fa2 paths (decode, and prefill at head dim > 256); its Hopper
        (fa3) prefill planner never splits the KV — one work item per 128-row query tile of one
        request over that request's whole KV (PrefillSM90Plan, flashinfer 0.7.2) — so a row's
        reduction order there does not follow the batch either."""
        if self.batch_invariant:
            return {"disable_split_kv": True}
        if graph_bucket is None:
            return {}
        sms = _sm_count(self.device)
        return {"disable_split_kv": True} if 0 < sms <= graph_bucket * layer.num_kv_heads else {}

    def sibling(self) -> FlashInferAttention:
        # Its own wrappers and its own float workspace: FlashInfer kernels of two concurrent
        # forwards must never share scratch memory or plan state.
        return FlashInferAttention(
            self.device, self.dtype, self.max_pages_per_seq, batch_invariant=self.batch_invariant
        )

    def run(
        self, group: int, layer: AttentionLayerSpec, q: torch.Tensor, pool_layer: torch.Tensor
    ) -> torch.Tensor:
        # Every query row's output is written by the kernel: an uninitialised buffer spares the
        # prefill wrapper's own zero-filled one (a memset launch per layer and step).
        q = q.contiguous()
        out: torch.Tensor = self._active[group].run(q, pool_layer, out=torch.empty_like(q))
        return out

    def warm_up_steps(self, specs: Sequence[AttentionLayerSpec], page_size: int) -> list[WarmUpStep]:
        """FlashInfer JIT-compiles one module per (head counts, head dim, window or not, kernel
        kind) on first use, for a minute or more each. One step per distinct geometry and kind
        plans and runs a two-token batch on a scratch sibling (its own workspace and wrappers, so
        this backend's plan state is untouched); FlashInfer caches the compiled modules."""
        steps: list[WarmUpStep] = []
        seen: set[tuple[int, int, int, bool]] = set()
        scratch = _Scratch(self)
        for spec in specs:
            key = (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.window is not None)
            if key in seen:
                continue
            seen.add(key)
            shape = f"{spec.num_heads}/{spec.num_kv_heads} heads, head dim {spec.head_dim}" + (
                f", window {spec.window}" if spec.window is not None else ""
            )
            steps.append(WarmUpStep(f"prefill · {shape}", partial(self._warm, scratch, spec, page_size, 2)))
            steps.append(WarmUpStep(f"decode · {shape}", partial(self._warm, scratch, spec, page_size, 1)))
        return steps

    def _warm(self, scratch: _Scratch, spec: AttentionLayerSpec, page_size: int, q_len: int) -> None:
        backend = scratch.backend()
        pool = KVPoolLayout(1, 2, spec.num_kv_heads, spec.head_dim, page_size).allocate(
            self.dtype, self.device
        )[0]
        q = torch.zeros(q_len, spec.num_heads, spec.head_dim, dtype=self.dtype, device=self.device)
        backend.plan(0, GroupBatch((q_len,), (2,), ((1,),), page_size), spec)
        backend.run(0, spec, q, pool)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _Scratch:
    """The one throwaway instance every warm-up step of a call shares (one workspace, not one per
    kernel), made when the first step runs."""

    def __init__(self, owner: FlashInferAttention) -> None:
        self._owner = owner
        self._backend: FlashInferAttention | None = None

    def backend(self) -> FlashInferAttention:
        if self._backend is None:
            self._backend = self._owner.sibling()
        return self._backend


class _DeviceIndices:
    """Each group's page indices on the device, copied there from a pinned host buffer without
    waiting for the stream.

    FlashInfer's graph-mode planners copy host indices into their buffer with a blocking copy (a
    non-blocking one only from a tensor already on the device; flashinfer 0.7.2): from pageable
    memory the host then waits for every kernel queued before it, so under async scheduling
    planning step N+1 waited for step N (the H100 host profile at df50211: 3.4 ms of a 4.8 ms step
    in that copy). Handed device indices, the planners copy device to device on the stream.

    One pair of buffers per group: an eager planner keeps the tensor it is given and its kernels
    read it later in the step, and a step plans every group before any runs. A group's pinned
    buffer is rewritten only at its next plan; the runner waits for the previous step's input
    copies before it plans another (engine/model_runner.py, `_wait_for_inputs`, synchronous steps
    and launched ones alike: FlashInfer's own pinned plan buffer needs the same), and the device
    buffer is reused in stream order.

    The buffers are ordinary tensors even when the first plan runs under ``torch.inference_mode``
    (start-up's profiling steps do; the graph captures plan outside it): an inference tensor cannot
    be written outside that mode. Off CUDA (tests) the same path runs with a pageable buffer."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def put(self, group: int, indices: np.ndarray) -> torch.Tensor:
        n = len(indices)
        pinned, on_device = self._buffers.get(group, (None, None))
        if pinned is None or on_device is None or pinned.numel() < n:
            size = max(n, 2 * (0 if pinned is None else pinned.numel()), 1024)
            with torch.inference_mode(False):
                pinned = torch.empty(size, dtype=torch.int32, pin_memory=self._device.type == "cuda")
                on_device = torch.empty(size, dtype=torch.int32, device=self._device)
            self._buffers[group] = (pinned, on_device)
        pinned[:n].copy_(torch.from_numpy(indices))
        on_device[:n].copy_(pinned[:n], non_blocking=True)
        return on_device[:n]
