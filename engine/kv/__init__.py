"""Paged KV: groups of 16-token pages with refcounts, a prefix cache, and per-request tables."""

from engine.kv.group import KVGroup
from engine.kv.manager import BudgetShortfall, KVConfigError, KVManager
from engine.kv.page_pool import PADDING_PAGE, OutOfPagesError, PagePool, PageRefError
from engine.kv.prefix_cache import PageHasher, PrefixIndex
from engine.kv.spec import KVGroupSpec

__all__ = [
    "PADDING_PAGE",
    "BudgetShortfall",
    "KVConfigError",
    "KVGroup",
    "KVGroupSpec",
    "KVManager",
    "OutOfPagesError",
    "PageHasher",
    "PagePool",
    "PageRefError",
    "PrefixIndex",
]
