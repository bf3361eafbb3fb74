"""Prefix caching across a full and a sliding KV group (engine/kv/manager.py), at the page level."""

from __future__ import annotations

from engine.kv import KVGroupSpec, KVManager
from engine.kv.page_pool import PADDING_PAGE

PAGE = 16
WINDOW = 20


def _manager(num_pages: int = 32) -> KVManager:
    return KVManager(
        [KVGroupSpec("full", num_pages), KVGroupSpec("sliding", num_pages, sliding_window=WINDOW)], "m"
    )


def _compute(kv: KVManager, rid: str, tokens: list[int], chunk: int = 16) -> None:
    """What the scheduler does for a prefill in chunks: release, allocate, compute, index."""
    done = 0
    while done < len(tokens):
        kv.release_window(rid, done)
        step = min(chunk, len(tokens) - done)
        assert kv.allocate(rid, done + step)
        done += step
        kv.computed(rid, tokens, done)


def test_hit_past_the_window_restores_only_the_window_in_the_sliding_group() -> None:
    kv = _manager()
    prompt = list(range(100, 180))  # 80 tokens: 5 full pages
    _compute(kv, "a", prompt)
    kv.free("a")
    assert kv.prefix_hit("b", prompt) == 4 * PAGE  # at least one token is left to compute
    full, sliding = kv.page_tables("b", 4 * PAGE)
    # Resuming at position 64 reads positions 45..63: pages 2 and 3 of the sliding group.
    assert all(p != PADDING_PAGE for p in full)
    assert sliding[:2] == (PADDING_PAGE, PADDING_PAGE) and all(p != PADDING_PAGE for p in sliding[2:])
    assert kv.live_pages("b") == [4, 2]
    # Growing and releasing carry on from the restored state.
    assert kv.allocate("b", 80)
    kv.release_window("b", 79)  # needs 60..79: sliding pages 0-2 out
    assert kv.live_pages("b") == [5, 2]
    kv.free("b")
    assert [g.pages_used for g in kv.load()] == [0, 0]


def test_an_evicted_sliding_page_outside_the_window_does_not_shorten_the_hit() -> None:
    kv = _manager(num_pages=7)  # 6 allocatable pages per group
    prompt = list(range(300, 380))
    _compute(kv, "a", prompt)
    kv.free("a")
    # Take 2 fresh sliding pages: the pool has 1 free page, then evicts its LRU cached page —
    # slot 0, released first, which a hit at 64 no longer reads.
    assert kv.allocate("x", 2 * PAGE)
    assert kv.prefix_hit("b", prompt) == 4 * PAGE
    kv.free("b")
    kv.free("x")


def test_a_missing_sliding_page_inside_the_window_shortens_the_hit() -> None:
    kv = _manager()
    prompt = list(range(500, 580))
    _compute(kv, "a", prompt)
    state_pages = kv.page_tables("a", 80)
    kv.free("a")
    # Forget sliding page 3: a hit at 64 needs it, a hit at 48 (reads 29..47: pages 1, 2) does not.
    kv.groups[1].index.forget_page(state_pages[1][3])
    assert kv.prefix_hit("b", prompt) == 3 * PAGE
    assert kv.page_tables("b", 3 * PAGE)[1][0] == PADDING_PAGE
