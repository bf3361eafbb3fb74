"""The paged KV pool layout every attention backend reads.

One pool tensor per KV group (one group per attention family) holds every layer of that group:

    pool[layer, page, kv, token, head, dim]     shape [layers, pages, 2, 16, kv_heads, head_dim]

- ``kv`` is 0 for K and 1 for V; ``token`` is the offset inside a 16-token page.
- ``pool[layer]`` is exactly FlashInfer's single-tensor NHD ``paged_kv_cache``
  (``[max_num_pages, 2, page_size, num_kv_heads, head_dim]``, ``kv_layout="NHD"``), a contiguous
  view, so the paged prefill/decode wrappers read a layer without any copy. The torch attention
  backend gathers the same view: ``pool[layer][page_ids, 0]`` are K pages, ``[page_ids, 1]`` V pages.
- A page id addresses the same page in every layer of its group, so one page table serves them all.
- Page 0 is the padding page: CUDA-graph filler rows point their page tables at it, write there,
  and nothing ever reads it. Its contents are undefined (several filler rows may race on one slot).
- A token's flat slot is ``page * 16 + offset``; ``kernels.reference.paged_slots`` is its one
  definition.

This module is the one home of the page size, the padding page and page arithmetic for every layer
above it (engine, models, gates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_SIZE = 16
PADDING_PAGE = 0
K_INDEX = 0
V_INDEX = 1


def ceil_div(numerator: int, denominator: int) -> int:
    """The smallest integer n with n · denominator ≥ numerator (both positive)."""
    return -(-numerator // denominator)


def pages_for(num_positions: int) -> int:
    """Pages a page table needs to cover positions [0, num_positions)."""
    return ceil_div(num_positions, PAGE_SIZE)


class KVLayoutError(ValueError):
    """A tensor does not have the pool layout it claims; carries the offending shape or value."""


@dataclass(slots=True, frozen=True)
class KVPoolLayout:
    """Dimensions of one KV group's pool."""

    layers: int
    pages: int
    kv_heads: int
    head_dim: int
    page_size: int = PAGE_SIZE

    def __post_init__(self) -> None:
        for name in ("layers", "pages", "kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if value < 1:
                raise KVLayoutError(f"{name} must be at least 1, got {value}")
        if self.pages < 2:
            # Page 0 is padding; a pool with no other page can hold no token.
            raise KVLayoutError(
                f"a pool needs the padding page and at least one more, got pages={self.pages}"
            )

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.layers, self.pages, 2, self.page_size, self.kv_heads, self.head_dim)

    def bytes(self, dtype: torch.dtype) -> int:
        elements = 1
        for extent in self.shape:
            elements *= extent
        return elements * dtype.itemsize

    def allocate(self, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """A zero-filled pool. Zeros, not garbage: the torch backend gathers (masked) slots of the
        padding page and of released sliding pages, and a NaN there survives a zero weight."""
        return torch.zeros(self.shape, dtype=dtype, device=device)


def check_pool_layer(pool_layer: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    """Raise unless ``pool_layer`` is one layer of a pool: ``[pages, 2, 16, kv_heads, head_dim]``.

    Only the innermost dimension must be dense: the kernels take every other stride as given.
    """
    if pool_layer.dim() != 5:
        raise KVLayoutError(
            f"a pool layer has 5 dims [pages, 2, 16, heads, dim], got shape {tuple(pool_layer.shape)}"
        )
    pages, kv, page_size, heads, dim = pool_layer.shape
    if kv != 2 or page_size != PAGE_SIZE or heads != kv_heads or dim != head_dim:
        raise KVLayoutError(
            f"pool layer shape {tuple(pool_layer.shape)} is not "
            f"[pages, 2, {PAGE_SIZE}, {kv_heads}, {head_dim}]"
        )
    if pages < 2:
        raise KVLayoutError(f"a pool layer needs the padding page and one more, got {pages} pages")
    if pool_layer.stride(-1) != 1:
        raise KVLayoutError(f"a pool layer's head_dim must be dense, got strides {pool_layer.stride()}")


def k_pages(pool_layer: torch.Tensor) -> torch.Tensor:
    """``[pages, 16, kv_heads, head_dim]`` view of the K half of one layer."""
    return pool_layer[:, K_INDEX]


def v_pages(pool_layer: torch.Tensor) -> torch.Tensor:
    """``[pages, 16, kv_heads, head_dim]`` view of the V half of one layer."""
    return pool_layer[:, V_INDEX]
