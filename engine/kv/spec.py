"""The scheduler's view of one KV group: how many pages, and whether it keeps only a window."""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract import ContractError
from kernels.kv_layout import PAGE_SIZE, pages_for


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One attention family's paged KV. `num_pages` counts the padding page 0, which is never
    handed to a request, so `num_pages - 1` pages are allocatable. A page id addresses every layer
    of its group. `sliding_window=W` means a token attends to positions `> pos - W` (the window
    includes the token itself), so older pages can be released."""

    name: str
    num_pages: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ContractError("name", self.name, "a KV group needs a name")
        if self.num_pages < 2:
            raise ContractError("num_pages", self.num_pages, "must be at least 2 (page 0 is padding)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ContractError("sliding_window", self.sliding_window, "must be at least 1 or None")

    @property
    def allocatable_pages(self) -> int:
        return self.num_pages - 1

    def max_live_pages(self, num_positions: int, max_chunk: int) -> int:
        """The most pages one request can hold at once when its KV spans `num_positions` and it
        is computed in chunks of at most `max_chunk` tokens: everything for a full group; for a
        sliding group, the pages touched by a window plus one chunk."""
        full = pages_for(num_positions)
        if self.sliding_window is None:
            return full
        # A chunk starting at s needs positions [s - W + 1, s + C - 1]: W + C - 1 positions, which
        # straddle at most (W + C - 2) // PAGE_SIZE + 2 pages.
        span = (self.sliding_window + max_chunk - 2) // PAGE_SIZE + 2
        return min(full, span)
