"""One KV group at run time: its spec, its page pool, and its slice of the prefix cache."""

from __future__ import annotations

from collections.abc import Callable

from engine.contract import GroupLoad
from engine.kv.page_pool import PagePool
from engine.kv.prefix_cache import PageHash, PrefixIndex
from engine.kv.spec import KVGroupSpec


class KVGroup:
    def __init__(self, spec: KVGroupSpec, on_forget: Callable[[PageHash], None] | None = None) -> None:
        self.spec = spec
        self.index = PrefixIndex()
        # `on_forget`: told the hash of every evicted indexed page (a state snapshot keyed by it
        # goes with it).
        self._on_forget = on_forget
        # An evicted page's old content is gone, so the index must forget it at the same moment.
        self.pool = PagePool(spec.num_pages, on_evict=self._evicted)

    def _evicted(self, page: int) -> None:
        page_hash = self.index.forget_page(page)
        if page_hash is not None and self._on_forget is not None:
            self._on_forget(page_hash)

    def release(self, page: int) -> None:
        """Drop one reference; a page the cache indexes stays cached (evictable), not wiped."""
        self.pool.decref(page, keep_cached=self.index.is_indexed(page))

    def load(self) -> GroupLoad:
        return GroupLoad(self.spec.name, self.pool.used, self.pool.total)
