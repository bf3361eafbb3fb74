"""One KV group at run time: its spec, its page pool, and its slice of the prefix cache."""

from __future__ import annotations

from engine.contract import GroupLoad
from engine.kv.page_pool import PagePool
from engine.kv.prefix_cache import PrefixIndex
from engine.kv.spec import KVGroupSpec


class KVGroup:
    def __init__(self, spec: KVGroupSpec) -> None:
        self.spec = spec
        self.index = PrefixIndex()
        # An evicted page's old content is gone, so the index must forget it at the same moment.
        self.pool = PagePool(spec.num_pages, on_evict=self.index.forget_page)

    def release(self, page: int) -> None:
        """Drop one reference; a page the cache indexes stays cached (evictable), not wiped."""
        self.pool.decref(page, keep_cached=self.index.is_indexed(page))

    def load(self) -> GroupLoad:
        return GroupLoad(self.spec.name, self.pool.used, self.pool.total)
