"""A model's KV groups as it declares them, and the device pools that hold them.

A paged model states its KV groups once, as `KVGroupShape`s (name, the attention geometry every
layer of the group shares, window included, and how many layers the group holds); `KVPools` turns
them into one pool tensor per group (kernels/kv_layout.py has the layout) and into the
`KVGroupSpec`s the scheduler gets once start-up has sized each group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv.spec import KVGroupSpec
from kernels.attention.base import AttentionLayerSpec
from kernels.kv_layout import KVPoolLayout

# The smallest pool a layout allows (the padding page and one more): what page costs are read from.
_SMALLEST_POOL = 2


@dataclass(frozen=True, slots=True)
class KVGroupShape:
    name: str
    attention: AttentionLayerSpec
    num_layers: int

    def layout(self, pages: int) -> KVPoolLayout:
        a = self.attention
        return KVPoolLayout(self.num_layers, pages, a.num_kv_heads, a.head_dim)

    def bytes_per_page(self, dtype: torch.dtype) -> int:
        """What one page id costs across every layer of the group."""
        return self.layout(_SMALLEST_POOL).bytes(dtype) // _SMALLEST_POOL

    def spec(self, num_pages: int) -> KVGroupSpec:
        """The scheduler's view of this group once it has `num_pages` pages."""
        return KVGroupSpec(self.name, num_pages, sliding_window=self.attention.window)


class KVPools:
    """One zero-filled pool tensor per KV group, all in one dtype on one device."""

    def __init__(self, shapes: Sequence[KVGroupShape], dtype: torch.dtype, device: torch.device) -> None:
        if not shapes:
            raise ValueError("a paged model needs at least one KV group")
        self.shapes = tuple(shapes)
        self.dtype = dtype
        self.device = device
        # Read on every step (packing and planning attention): built once.
        self.attention_specs: tuple[AttentionLayerSpec, ...] = tuple(s.attention for s in self.shapes)
        # Empty until start-up sizes them (engine.paged_startup).
        self.pools: list[torch.Tensor] = []

    def bytes_per_page(self) -> tuple[int, ...]:
        return tuple(s.bytes_per_page(self.dtype) for s in self.shapes)

    @property
    def num_pages(self) -> tuple[int, ...]:
        return tuple(int(p.shape[1]) for p in self.pools)

    def allocate(self, pages: Sequence[int]) -> None:
        """(Re)allocate every group's pool, group g with `pages[g]` pages (page 0 included)."""
        if len(pages) != len(self.shapes):
            names = [s.name for s in self.shapes]
            raise ValueError(f"KV groups {names} got page counts {tuple(pages)}")
        # Drop the old pools first so the two never coexist on the device.
        self.pools = []
        self.pools = [
            s.layout(n).allocate(self.dtype, self.device) for s, n in zip(self.shapes, pages, strict=True)
        ]

    def layer(self, group: int, index: int) -> torch.Tensor:
        """Layer `index` of group `group`'s pool: [pages, 2, 16, kv_heads, head_dim]."""
        return self.pools[group][index]

    def specs(self) -> tuple[KVGroupSpec, ...]:
        """The scheduler's KV groups at the pools' current sizes."""
        return tuple(s.spec(n) for s, n in zip(self.shapes, self.num_pages, strict=True))
