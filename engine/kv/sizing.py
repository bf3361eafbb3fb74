"""How many pages each KV group gets: pure arithmetic over per-group costs, unit-tested on the CPU.

A sliding group never holds more than `KVGroupSpec.max_live_pages` pages for one request, so it gets
what `max_num_seqs` such requests hold at once (plus the padding page), never more than the full
groups get; the full groups, which hold whole contexts, take the rest of the bytes. The cap keeps a
sliding group from ever being the group that refuses a request the full groups can hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.kv.pools import KVGroupShape
from engine.kv.spec import KVGroupSpec


@dataclass(frozen=True, slots=True)
class KVGroupCost:
    """What sizing needs of one KV group: the bytes one page id costs across its layers, and, for
    a sliding group, the most pages it can ever need (padding page included); None: a full group,
    which needs as many pages as the context it holds."""

    bytes_per_page: int
    sliding_need: int | None = None

    def __post_init__(self) -> None:
        if self.bytes_per_page < 1:
            raise ValueError(f"bytes_per_page must be at least 1, got {self.bytes_per_page}")
        if self.sliding_need is not None and self.sliding_need < 2:
            raise ValueError(f"sliding_need must be at least 2 (page 0 is padding), got {self.sliding_need}")


def sliding_need(window: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Pages a sliding group needs so that `max_num_seqs` requests can each hold the most pages one
    request ever holds (the scheduler's own bound, `KVGroupSpec.max_live_pages`), plus page 0."""
    spec = KVGroupSpec("sliding", 2, sliding_window=window)
    return max_num_seqs * spec.max_live_pages(max_model_len, max_num_batched_tokens) + 1


def split_kv_pages(full_pages: int, groups: Sequence[KVGroupCost]) -> tuple[int, ...]:
    """Page counts when the full groups' count is given (`--num-kv-pages`): every full group gets
    `full_pages`, a sliding group its need capped at `full_pages`. The cap keeps a sliding group
    from ever being the one that refuses a request: either it holds `max_num_seqs` requests'
    worth, or as many pages as the full groups, and a request never needs more sliding pages
    than full ones."""
    if full_pages < 2:
        raise ValueError(f"full_pages must be at least 2 (page 0 is padding), got {full_pages}")
    return tuple(full_pages if g.sliding_need is None else min(g.sliding_need, full_pages) for g in groups)


def _bytes_at(full_pages: int, groups: Sequence[KVGroupCost]) -> int:
    return sum(g.bytes_per_page * n for g, n in zip(groups, split_kv_pages(full_pages, groups), strict=True))


def split_kv_bytes(kv_bytes: int, groups: Sequence[KVGroupCost]) -> tuple[int, ...]:
    """Page counts for `kv_bytes` of KV across all groups: the largest full-group count F whose
    `split_kv_pages(F)` fits, so the sliding groups take their need (capped at F) and the full
    groups the rest. At least 2 pages per group. A model with no sliding group gets
    `kv_bytes // bytes_per_page`; one with no full group gets exactly its sliding needs (more could
    never be used)."""
    if not groups:
        raise ValueError("a model needs at least one KV group, got none")
    if kv_bytes < 0:
        raise ValueError(f"kv_bytes must not be negative, got {kv_bytes}")
    full_bytes = sum(g.bytes_per_page for g in groups if g.sliding_need is None)
    # Sliding pages cost bytes too, so F never exceeds what the full groups alone could take; with
    # no full group, F past the largest sliding need changes nothing.
    hi = max(2, kv_bytes // full_bytes) if full_bytes else max(g.sliding_need or 2 for g in groups)
    # The bytes split_kv_pages(F) takes grow with F: binary search for the largest F that fits.
    lo = 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _bytes_at(mid, groups) <= kv_bytes:
            lo = mid
        else:
            hi = mid - 1
    return split_kv_pages(lo, groups)


def group_costs(
    shapes: Sequence[KVGroupShape], bytes_per_page: Sequence[int], config: EngineConfig, max_model_len: int
) -> tuple[KVGroupCost, ...]:
    """Each KV group as sizing sees it: its page cost, and its need when it slides."""
    return tuple(
        KVGroupCost(
            size,
            None
            if shape.attention.window is None
            else sliding_need(
                shape.attention.window, max_model_len, config.max_num_seqs, config.max_num_batched_tokens
            ),
        )
        for shape, size in zip(shapes, bytes_per_page, strict=True)
    )


def configured_kv_pages(config: EngineConfig, groups: Sequence[KVGroupCost]) -> tuple[int, ...] | None:
    """--num-kv-pages (the full groups' count), else --kv-cache-memory (bytes over all groups);
    None: size from the measured budget."""
    if config.num_kv_pages is not None:
        return split_kv_pages(config.num_kv_pages, groups)
    if config.kv_cache_memory is not None:
        return split_kv_bytes(config.kv_cache_memory, groups)
    return None


def snapshot_slots(config: EngineConfig) -> int:
    """State snapshots a recurrent model reserves beside its running slots (engine/kv/snapshots.py):
    one per `--max-num-seqs` with prefix caching, none without. Each costs what a running slot
    costs; a prefix hit needs one at its depth, and the least recently used goes when a new one
    needs the room, so the count bounds how many distinct cached prefixes stay resumable."""
    return config.max_num_seqs if config.enable_prefix_caching else 0
