"""The model side of a step: the device inputs one forward reads (built by engine.step_packer), the
pinned host buffers they travel through under async scheduling, and the protocol a paged causal LM
implements so the generic runner and the CUDA-graph decoder can drive it."""

from __future__ import annotations

from collections.abc import Callable
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
    # The rows' token boundaries in the packed step, on the host (row r is tokens cu[r]:cu[r+1]);
    # None when every row is one token. Kept on the host so a varlen kernel's launch needs no sync.
    cu_seqlens: tuple[int, ...] | None = None
    # Prefill graphs' cut points (engine/prefill_graphs.py); None: `host_planned` ops run as called.
    cuts: HostPlannedCuts | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def host_planned(self, name: str, op: HostPlannedOp, x: torch.Tensor, width: int) -> torch.Tensor:
        """``op(x, self)``, [tokens, width] from x [tokens, ...]: an op planned on the host from this
        step's rows other than attention (a recurrent layer's varlen kernels). Under prefill graphs
        a cut point, where `op` runs between two replayed segments on the live step (docs/engine.md,
        "Prefill graphs"); `name` tells such ops apart."""
        if self.cuts is None:
            return op(x, self)
        return self.cuts.cut(name, op, x, width)

    def pinned(self, staging: HostStaging) -> ForwardBatch:
        """The same batch on the host, in `staging`'s pinned buffers: copies from there to the device
        are truly asynchronous (from pageable memory the driver may wait for the stream). With
        staging that is not pinned (a host device), the batch itself."""
        if not staging.pinned:
            return self

        def staged(name: str, t: torch.Tensor) -> torch.Tensor:
            return staging.stage(name, t)

        positions, seq_index = (
            staged("positions", self.positions),
            staged("seq_index", self.rows[0].seq_index),
        )
        return ForwardBatch(
            input_ids=staged("input_ids", self.input_ids),
            positions=positions,
            rows=tuple(
                PagedRows(positions, seq_index, staged(f"page_table{g}", r.page_table))
                for g, r in enumerate(self.rows)
            ),
            sample_index=staged("sample_index", self.sample_index),
            attention=self.attention,
            state_slots=None if self.state_slots is None else staged("state_slots", self.state_slots),
            cu_seqlens=self.cu_seqlens,
            cuts=self.cuts,
        )

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
            cu_seqlens=self.cu_seqlens,
            cuts=self.cuts,
        )


HostPlannedOp = Callable[[torch.Tensor, "ForwardBatch"], torch.Tensor]


class HostPlannedCuts(Protocol):
    def cut(self, name: str, op: HostPlannedOp, x: torch.Tensor, width: int) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class RooflineFacts:
    """What one forward must move and compute, for benchmarks' floors.

    A decode step reads every matmul weight once (`weight_bytes`) plus each row's KV, and a model
    with recurrent layers reads each row's state and writes it back (`state_bytes_per_row`, every
    recurrent layer's conv and recurrent state); a prefill of L tokens does 2·matmul_params·L flops
    in projections plus attention, whose score and value products cost `attention_flops_per_pair`
    for each (query, visible key) pair."""

    weight_bytes: int
    matmul_params: int
    kv_bytes_per_token: int
    attention_flops_per_pair: int
    state_bytes_per_row: int = 0


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


class HostStaging:
    """Persistent host buffers, one per name, that one launch's inputs and outputs pass through.

    On a CUDA device they are pinned (page-locked), so `non_blocking` copies neither way wait for
    the stream; elsewhere `stage` and `output` hand tensors back as they are. A buffer grows when a
    step needs more than it holds. The caller must not restage a name while a copy from it may still
    be queued: `StagingRing` hands a set out again only once its last launch has finished."""

    def __init__(self, device: torch.device) -> None:
        self._pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def pinned(self) -> bool:
        """Whether the buffers are pinned (a CUDA device); otherwise tensors pass through as they are."""
        return self._pinned

    def stage(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (host) copied into the pinned buffer `name`."""
        if not self._pinned:
            return tensor
        view = self._view(name, tensor)
        view.copy_(tensor)
        return view

    def output(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor shaped like `like` (on the device) to copy it into; on a host device,
        `like` itself."""
        if not self._pinned:
            return like
        return self._view(name, like)

    def _view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        numel = like.numel()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != like.dtype or buffer.numel() < numel:
            size = max(numel, 2 * buffer.numel() if buffer is not None else 0, 64)
            buffer = torch.empty(size, dtype=like.dtype, pin_memory=True)
            self._buffers[name] = buffer
        return buffer[:numel].view(like.shape)


class StagingRing:
    """Two `HostStaging` sets used in turn, one per launch: the launch in flight reads one while the
    next is packed into the other. A set is handed out again only after the event of the launch that
    last used it (recorded after its outputs' copies) has completed; under async scheduling that
    launch was collected a step ago, so the wait is normally already over."""

    def __init__(self, device: torch.device, sets: int = 2) -> None:
        self._sets = [HostStaging(device) for _ in range(sets)]
        self._released: list[torch.cuda.Event | None] = [None] * sets
        self._next = 0

    def take(self) -> tuple[int, HostStaging]:
        i = self._next
        self._next = (i + 1) % len(self._sets)
        released = self._released[i]
        if released is not None:
            released.synchronize()
            self._released[i] = None
        return i, self._sets[i]

    def release_after(self, index: int, event: torch.cuda.Event | None) -> None:
        self._released[index] = event
