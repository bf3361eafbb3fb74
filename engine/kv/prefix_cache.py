"""The prefix cache's index: a hash chain over full pages of token ids, per KV group.

Page i's hash covers its page_size token ids and page i-1's hash, so equal hashes mean equal
prefixes. The chain is keyed by a model identity so two models never share KV. The index only maps
hashes to page ids; refcounts and the LRU live in the group's `PagePool`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

PageHash = bytes


class PageHasher:
    """Hashes one page of token ids onto its parent's hash, salted by the model identity."""

    def __init__(self, model_id: str) -> None:
        # blake2b's key is at most 64 bytes; hash the identity first so any string works.
        self._key = hashlib.blake2b(model_id.encode(), digest_size=32).digest()

    def page_hash(self, parent: PageHash | None, token_ids: Sequence[int]) -> PageHash:
        h = hashlib.blake2b(key=self._key, digest_size=16)
        h.update(parent if parent is not None else b"root")
        h.update(array("q", token_ids).tobytes())
        return h.digest()

    def extend(
        self, hashes: list[PageHash], token_ids: Sequence[int], num_pages: int, page_size: int
    ) -> None:
        """Grow `hashes` (the chain of a token sequence) to cover its first `num_pages` pages."""
        while len(hashes) < num_pages:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(self.page_hash(parent, token_ids[i * page_size : (i + 1) * page_size]))


class PrefixIndex:
    """hash -> page and page -> hash for one KV group. Every indexed page holds exactly the tokens
    its hash names: a page is indexed only once it is full and its KV has been written."""

    def __init__(self) -> None:
        self._by_hash: dict[PageHash, int] = {}
        self._by_page: dict[int, PageHash] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def find(self, page_hash: PageHash) -> int | None:
        return self._by_hash.get(page_hash)

    def is_indexed(self, page: int) -> bool:
        return page in self._by_page

    def insert(self, page_hash: PageHash, page: int) -> bool:
        """Index a page; False when the hash already names another page (a duplicate computed
        concurrently stays private and is simply freed later) or the page is already indexed."""
        if page_hash in self._by_hash or page in self._by_page:
            return False
        self._by_hash[page_hash] = page
        self._by_page[page] = page_hash
        return True

    def forget_page(self, page: int) -> PageHash | None:
        """The pool evicted `page` to reuse it: its old content is gone. Returns the hash it held."""
        page_hash = self._by_page.pop(page, None)
        if page_hash is not None:
            del self._by_hash[page_hash]
        return page_hash
