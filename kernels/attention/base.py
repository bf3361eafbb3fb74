"""The attention-backend seam: plan once per step and KV group, run once per layer.

A backend reads K and V straight from a layer's slice of its group's paged pool (see
kernels/kv_layout.py), so the prep kernel's writes are what attention sees. Queries of one sequence
are contiguous rows; sequence i's queries sit at the last `q_lens[i]` positions of its `kv_lens[i]`
tokens, and each attends causally (and, on a sliding layer, to the last `window` positions only,
its own included).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    # Sliding layers: how many positions a query sees, its own included. None: all before it.
    window: int | None = None


@dataclass(frozen=True, slots=True)
class GroupBatch:
    """One step's sequences as one KV group sees them (host-side, built by the model runner)."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_tables: tuple[tuple[int, ...], ...]
    page_size: int

    def __post_init__(self) -> None:
        n = len(self.q_lens)
        if len(self.kv_lens) != n or len(self.page_tables) != n:
            raise ValueError(
                f"GroupBatch: {n} q_lens, {len(self.kv_lens)} kv_lens, {len(self.page_tables)} tables"
            )
        # Built once per KV group per step: the rows are checked in one plain pass (one chained
        # comparison a row), and only a batch that fails is walked again to name its first bad row.
        page_size = self.page_size
        for q, kv, table in zip(self.q_lens, self.kv_lens, self.page_tables, strict=True):
            if not 1 <= q <= kv <= len(table) * page_size:
                self._refuse_first_bad_row()

    def _refuse_first_bad_row(self) -> NoReturn:
        for i, (q, kv, table) in enumerate(zip(self.q_lens, self.kv_lens, self.page_tables, strict=True)):
            if not (1 <= q <= kv):
                raise ValueError(f"GroupBatch: sequence {i} has q_len {q} and kv_len {kv}")
            if len(table) * self.page_size < kv:
                raise ValueError(
                    f"GroupBatch: sequence {i} needs {kv} slots but its table has {len(table)} pages"
                )
        raise AssertionError("GroupBatch: a row failed the check, yet no row is named")

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


@dataclass(frozen=True, slots=True)
class WarmUpStep:
    """One kernel a backend builds on first use, and a call that makes it build now."""

    description: str
    run: Callable[[], None]


class AttentionBackend(ABC):
    name: str
    # Whether `plan(..., graph_bucket=B)` is supported: decode-only steps padded to B rows, planned
    # into buffers whose addresses never change so a captured CUDA graph can replay them.
    supports_graphs: bool = False

    @abstractmethod
    def plan(
        self, group: int, batch: GroupBatch, layer: AttentionLayerSpec, graph_bucket: int | None = None
    ) -> None:
        """Prepare the step's metadata for one KV group, whose layers all share `layer`'s geometry
        (host work happens here, not in run). With `graph_bucket`, the batch is a decode step of
        exactly that many rows planned into that bucket's fixed buffers."""

    @abstractmethod
    def run(
        self, group: int, layer: AttentionLayerSpec, q: torch.Tensor, pool_layer: torch.Tensor
    ) -> torch.Tensor:
        """q: [tokens, num_heads, head_dim]; pool_layer: [pages, 2, page_size, kv_heads, head_dim].
        Returns [tokens, num_heads, head_dim] in q's dtype."""

    def sibling(self) -> AttentionBackend:
        """A new backend of the same kind and settings with its own plan state and scratch memory,
        so a second forward (an overlapped prefill on another stream) can plan and run while this
        one's step is still running."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot make a concurrent sibling")

    def warm_up_steps(self, specs: Sequence[AttentionLayerSpec], page_size: int) -> list[WarmUpStep]:
        """The kernels `specs` will need that this backend compiles on first use, each with a call
        that compiles it now (start-up shows them with a progress bar instead of stalling inside
        the first forward). Backends with nothing to compile return none."""
        return []
