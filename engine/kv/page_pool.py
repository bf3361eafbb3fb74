"""One KV group's pages: refcounts, a free list, and the LRU of cached pages nobody references.

Page 0 is the padding page: it is never allocated, never freed, and never counted. A page whose
refcount drops to zero either returns to the free list or, when its content is a full page the
prefix cache indexes, parks in the evictable LRU; allocation evicts from there only when the free
list runs dry, telling the cache to forget the evicted page.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kernels.kv_layout import PADDING_PAGE


class OutOfPagesError(RuntimeError):
    def __init__(self, wanted: int, available: int) -> None:
        super().__init__(f"asked for {wanted} KV pages but only {available} are available")
        self.wanted = wanted
        self.available = available


class PageRefError(RuntimeError):
    def __init__(self, page: int, why: str) -> None:
        super().__init__(f"page {page}: {why}")
        self.page = page


class PagePool:
    def __init__(self, num_pages: int, on_evict: Callable[[int], None] | None = None) -> None:
        self._num_pages = num_pages
        self._refs = [0] * num_pages
        # A stack, lowest id on top: allocation order is deterministic, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, PADDING_PAGE, -1))
        # Cached pages with no reference, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._on_evict = on_evict
        self._used = 0

    # -- facts ---------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        return self._num_pages - 1

    @property
    def used(self) -> int:
        """Pages at least one request references; cached-but-unreferenced pages are not used."""
        return self._used

    @property
    def available(self) -> int:
        """Pages an allocation may take now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # -- transitions ---------------------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        """`count` fresh pages, each with refcount 1; all or none."""
        if count > self.available:
            raise OutOfPagesError(count, self.available)
        pages: list[int] = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                if self._on_evict is not None:
                    self._on_evict(page)
            self._refs[page] = 1
            pages.append(page)
        self._used += count
        return pages

    def incref(self, page: int) -> None:
        """Take a reference to a page that already holds content (a prefix-cache hit)."""
        self._check(page)
        if self._refs[page] == 0:
            if page not in self._evictable:
                raise PageRefError(page, "is free; only a cached page can be re-referenced")
            del self._evictable[page]
            self._used += 1
        self._refs[page] += 1

    def decref(self, page: int, keep_cached: bool) -> None:
        """Drop a reference. At zero the page parks in the evictable LRU when `keep_cached` (its
        content is indexed by the prefix cache), otherwise it returns to the free list."""
        self._check(page)
        refs = self._refs[page]
        if refs <= 0:
            raise PageRefError(page, "released more often than it was taken")
        self._refs[page] = refs - 1
        if refs == 1:
            self._used -= 1
            if keep_cached:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def _check(self, page: int) -> None:
        if not (PADDING_PAGE < page < self._num_pages):
            raise PageRefError(page, f"not an allocatable page id (1..{self._num_pages - 1})")
