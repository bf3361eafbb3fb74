"""Page pool refcounts and LRU, the salted hash chain, and the KV manager across groups."""

from __future__ import annotations

import random

import pytest

from engine.kv import (
    PADDING_PAGE,
    KVGroupSpec,
    KVManager,
    OutOfPagesError,
    PageHasher,
    PagePool,
    PageRefError,
)
from kernels.kv_layout import pages_for


def test_pool_never_hands_out_the_padding_page_and_is_all_or_nothing() -> None:
    pool = PagePool(5)
    assert pool.total == 4 and pool.available == 4
    pages = pool.allocate(3)
    assert PADDING_PAGE not in pages and len(set(pages)) == 3
    with pytest.raises(OutOfPagesError) as info:
        pool.allocate(2)
    assert (info.value.wanted, info.value.available) == (2, 1)
    # The failed allocation took nothing.
    assert pool.available == 1 and pool.used == 3


def test_pool_refcounts() -> None:
    pool = PagePool(4)
    (page,) = pool.allocate(1)
    pool.incref(page)
    assert pool.refcount(page) == 2 and pool.used == 1
    pool.decref(page, keep_cached=False)
    assert pool.used == 1
    pool.decref(page, keep_cached=False)
    assert pool.used == 0 and pool.available == 3
    with pytest.raises(PageRefError):
        pool.decref(page, keep_cached=False)
    with pytest.raises(PageRefError):
        pool.incref(page)  # a free page holds nothing worth referencing
    with pytest.raises(PageRefError):
        pool.incref(PADDING_PAGE)


def test_cached_pages_are_not_used_and_evict_lru_only_when_free_list_is_dry() -> None:
    evicted: list[int] = []
    pool = PagePool(5, on_evict=evicted.append)
    a, b, c, d = pool.allocate(4)
    pool.decref(b, keep_cached=True)
    pool.decref(a, keep_cached=True)
    pool.decref(c, keep_cached=False)
    assert pool.used == 1 and pool.num_evictable == 2 and pool.available == 3
    # The free page goes first; nothing is evicted while the free list has pages.
    assert pool.allocate(1) == [c] and evicted == []
    # Then the least recently released cached page.
    assert pool.allocate(1) == [b] and evicted == [b]
    # Re-referencing a cached page pulls it out of the LRU.
    pool.incref(a)
    assert pool.num_evictable == 0 and pool.used == 4
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    assert d in (1, 2, 3, 4)


def test_hash_chain_is_salted_and_covers_the_whole_prefix() -> None:
    h = PageHasher("model-a")
    page1, page2, other1 = list(range(16)), list(range(16, 32)), [99, *range(1, 16)]
    first = h.page_hash(None, page1)
    assert first == PageHasher("model-a").page_hash(None, page1)
    assert first != PageHasher("model-b").page_hash(None, page1)
    # Same second page after a different first page: a different chain.
    assert h.page_hash(first, page2) != h.page_hash(h.page_hash(None, other1), page2)
    chain: list[bytes] = []
    h.extend(chain, page1 + page2 + [1, 2, 3], 2, 16)
    assert chain == [first, h.page_hash(first, page2)]


def _manager(num_pages: int = 32, *, model_id: str = "m", sliding: int | None = None) -> KVManager:
    specs = [KVGroupSpec("full", num_pages)]
    if sliding is not None:
        specs.append(KVGroupSpec("sliding", num_pages, sliding_window=sliding))
    return KVManager(specs, model_id)


def _compute(kv: KVManager, rid: str, tokens: list[int]) -> None:
    assert kv.prefix_hit(rid, tokens) == 0
    assert kv.allocate(rid, len(tokens))
    kv.computed(rid, tokens, len(tokens))


def test_prefix_hit_shares_full_written_pages_and_leaves_a_token_to_compute() -> None:
    kv = _manager()
    prompt = list(range(100, 140))  # 2 full pages + 8 tokens
    _compute(kv, "a", prompt)
    a_pages = kv.page_tables("a", 40)[0]
    # Same prompt: both full pages hit, the partial third page is never shared.
    assert kv.prefix_hit("b", prompt) == 32
    assert kv.page_tables("b", 32)[0] == a_pages[:2]
    # A prompt of exactly two pages reuses only one: its last token must be computed.
    assert kv.prefix_hit("c", prompt[:32]) == 16
    # A different first token: no hit anywhere along the chain.
    assert kv.prefix_hit("d", [7, *prompt[1:]]) == 0
    assert kv.load()[0].pages_used == 3


def test_a_page_is_shared_only_once_its_kv_is_written() -> None:
    kv = _manager()
    prompt = list(range(40))
    assert kv.allocate("a", 40)
    kv.computed("a", prompt, 20)  # the second page is still being written
    assert kv.prefix_hit("b", prompt) == 16


def test_finished_pages_stay_cached_unused_then_evict_lru() -> None:
    kv = _manager(num_pages=5)  # 4 allocatable pages
    _compute(kv, "a", list(range(33)))  # 3 pages, 2 full
    kv.free("a")
    (load,) = kv.load()
    assert load.pages_used == 0 and load.pages_total == 4
    assert kv.prefix_hit("a2", list(range(33))) == 32
    kv.free("a2")
    # Fill the pool: the cached pages are evicted, tail first, and the chain is gone.
    assert kv.allocate("x", 16 * 3)
    assert kv.prefix_hit("a3", list(range(33))) == 16
    assert kv.allocate("y", 16 * 1) is False  # the hit page is referenced, nothing left
    kv.free("a3")
    assert kv.allocate("y", 16)
    assert kv.prefix_hit("a4", list(range(33))) == 0


def test_prefix_cache_is_per_model() -> None:
    kv = _manager(model_id="one")
    _compute(kv, "a", list(range(40)))
    index = kv.groups[0].index
    assert index.find(PageHasher("one").page_hash(None, list(range(16)))) is not None
    assert index.find(PageHasher("two").page_hash(None, list(range(16)))) is None


def test_allocation_is_all_or_nothing_across_groups() -> None:
    kv = KVManager([KVGroupSpec("big", 20), KVGroupSpec("small", 3)], "m")
    assert kv.allocate("a", 32)  # 2 pages in each group: "small" is now full
    before = [g.pages_used for g in kv.load()]
    assert kv.allocate("b", 16) is False
    assert [g.pages_used for g in kv.load()] == before
    assert kv.fit("b", 0, 64) == 0
    kv.free("a")
    assert kv.fit("b", 0, 64) == 32 and kv.allocate("b", 32)


def test_sliding_group_releases_pages_behind_the_window() -> None:
    kv = _manager(sliding=20)
    assert kv.prefix_caching is True  # sliding groups cache too (their hits start window-released)
    assert kv.allocate("a", 64)
    tokens = list(range(100, 164))
    # The token at position 36 needs positions 17..36: page 0 (0..15) is out, page 1 is not. A
    # page is released only once indexed, so that a later request can still hit it.
    kv.release_window("a", 36)
    assert kv.live_pages("a") == [4, 4]
    kv.computed("a", tokens, 36)
    kv.release_window("a", 36)
    full, sliding = kv.page_tables("a", 64)
    assert sliding[0] == PADDING_PAGE and all(p != PADDING_PAGE for p in sliding[1:])
    assert all(p != PADDING_PAGE for p in full)
    assert kv.live_pages("a") == [4, 3]
    kv.computed("a", tokens, 52)
    kv.release_window("a", 52)  # needs 33..52: pages 0 and 1 go
    assert kv.live_pages("a") == [4, 2]
    sliding_load = kv.load()[1]
    assert sliding_load.pages_used == 2
    kv.free("a")
    assert [g.pages_used for g in kv.load()] == [0, 0]


def test_budget_shortfall_names_the_group() -> None:
    kv = _manager(num_pages=9, sliding=32)  # 8 pages per group
    assert kv.shortfall(16 * 8, max_chunk=16) is None
    short = kv.shortfall(16 * 8 + 1, max_chunk=16)
    assert short is not None and short.group == "full" and short.needed == 9
    # The sliding group needs only a window plus a chunk, however long the request.
    assert KVGroupSpec("s", 9, sliding_window=32).max_live_pages(10_000, 16) == 4


def test_a_prefix_hit_needs_the_page_in_every_group() -> None:
    kv = KVManager([KVGroupSpec("roomy", 64), KVGroupSpec("tight", 4)], "m")
    prompt = list(range(200, 240))
    _compute(kv, "a", prompt)  # 3 pages per group; 2 full pages indexed in both
    kv.free("a")
    assert kv.prefix_hit("probe", prompt) == 32
    kv.free("probe")
    # Two more pages in the tight group: its free page, then its LRU cached page (the chain's
    # tail) is evicted. The roomy group still holds both, but a hit is only usable where every
    # group holds it.
    assert kv.allocate("x", 32)
    assert kv.load()[1].pages_used == 2 and kv.groups[1].pool.num_evictable == 1
    assert kv.prefix_hit("b", prompt) == 16
    assert kv.live_pages("b") == [1, 1]


def test_page_tables_are_each_groups_table_cut_to_the_end_and_cached_until_a_change() -> None:
    """`page_tables` hands out one cached tuple per request while no table changes: it must equal,
    after any allocation, window release, re-admission through a prefix hit or free, the plain
    definition (each group's live table cut to pages_for(end)); every group's table has the same
    length, which is what lets it and `allocate` look at the first group only."""
    rng = random.Random(3)
    kv = _manager(64, sliding=40)
    ends: dict[str, int] = {}
    prompts = {rid: [rng.randrange(50) for _ in range(200)] for rid in ("a", "b", "c")}
    for _ in range(400):
        rid = rng.choice(sorted(prompts))
        tokens = prompts[rid]
        if rid not in ends:
            ends[rid] = max(1, kv.prefix_hit(rid, tokens))
            if not kv.allocate(rid, ends[rid]):
                kv.free(rid)
                del ends[rid]
                continue
        action = rng.random()
        if action < 0.6 and ends[rid] < len(tokens):
            end = min(len(tokens), ends[rid] + rng.choice([1, 1, 5, 17]))
            if kv.allocate(rid, end):
                kv.computed(rid, tokens, ends[rid])
                ends[rid] = end
                kv.release_window(rid, end - 1)
        elif action < 0.7:
            kv.free(rid, keep_hashes=rng.random() < 0.5)
            del ends[rid]
            continue
        state_tables = kv._requests[rid].tables
        assert len({len(t) for t in state_tables}) == 1
        end = ends[rid]
        want = tuple(tuple(t[: pages_for(end)]) for t in state_tables)
        got = kv.page_tables(rid, end)
        assert got == want
        if len(state_tables[0]) == pages_for(end):
            assert kv.page_tables(rid, end) is got  # nothing changed: the same tuples
