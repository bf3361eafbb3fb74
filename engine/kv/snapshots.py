"""State snapshots: the prefix cache's half for a model with recurrent state (Qwen3.5's GDN layers).

A cached KV page is only reusable together with the recurrent state at the position where the reused
prefix ends, so a hit can stop only at a page boundary where a snapshot was taken. A snapshot is a
state-pool slot (engine/kv/state_pool.py) holding a copy of a request's conv + recurrent state right
after a prefill row that ended on a page boundary, keyed by the hash of the page that ends there (the
same hash chain as the KV pages, so equal keys mean equal token prefixes).

Lifetimes:
- `take` hands out a slot for a snapshot the step being built will write: it is *pending* (the
  copy runs after that step's forward) and no one may read it or take it until `commit` or
  `release`. Under async scheduling it stays pending until the launched step is collected.
- `commit` makes it findable once the step ran (was collected) and its pages are indexed; it is
  then in the LRU.
- A committed snapshot goes when its page hash leaves the KV index (`forget`: the page was
  evicted, so no hit can reach that depth any more), or when `take` needs a slot and none is free
  (least recently used first; its page stays cached, and a hit then stops at a shallower snapshot).
- With every slot pending, `take` returns None: that boundary gets no snapshot, and no hit stops
  there. It never hands out a slot whose content something may still read.

A restore is only ever read before the forward of the step that admits the hit, and a snapshot is
only written after a step's forward, both on one stream, so taking a slot that a restore in the same
step reads is safe. The same holds across steps launched ahead under async scheduling: a slot is
found (restored from) only after the step writing it was collected, and every later use of a slot
taken or freed while a launched step still restores from it is a copy queued after that read, on
the same stream; the host never needs to wait for a launched step before recycling a committed slot
(engine/scheduler.py tells the scheduler's half).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine.kv.prefix_cache import PageHash


class SnapshotError(RuntimeError):
    def __init__(self, slot: int, why: str) -> None:
        super().__init__(f"state snapshot slot {slot}: {why}")
        self.slot = slot


class SnapshotCache:
    """The state-pool slots reserved for snapshots and what each one holds."""

    def __init__(self, slots: Iterable[int]) -> None:
        ids = list(slots)
        if len(set(ids)) != len(ids):
            raise ValueError(f"snapshot slots must be distinct, got {ids}")
        self.total = len(ids)
        # A stack, lowest id on top: deterministic order keeps tests readable.
        self._free = sorted(ids, reverse=True)
        self._pending: set[int] = set()
        self._by_hash: dict[PageHash, int] = {}
        self._by_slot: dict[int, PageHash] = {}
        # Committed snapshots, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.evicted_for_space = 0

    # -- facts ---------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Committed snapshots (findable)."""
        return len(self._by_slot)

    @property
    def pending(self) -> int:
        """Slots taken for a snapshot the current step will write."""
        return len(self._pending)

    def find(self, page_hash: PageHash) -> int | None:
        return self._by_hash.get(page_hash)

    def hashes(self) -> tuple[PageHash, ...]:
        return tuple(self._by_hash)

    # -- transitions ---------------------------------------------------------------------------

    def touch(self, slot: int) -> None:
        """A hit restored from `slot`: it is the most recently used now."""
        if slot in self._lru:
            self._lru.move_to_end(slot)

    def take(self) -> int | None:
        """A slot for a new snapshot: a free one, else the least recently used committed one
        (forgotten); None when every slot is pending."""
        if self._free:
            slot = self._free.pop()
        elif self._lru:
            slot, _ = self._lru.popitem(last=False)
            del self._by_hash[self._by_slot.pop(slot)]
            self.evicted_for_space += 1
        else:
            return None
        self._pending.add(slot)
        return slot

    def commit(self, slot: int, page_hash: PageHash) -> bool:
        """The pending snapshot in `slot` now holds the state at the end of `page_hash`'s page;
        False (and the slot is freed) when that prefix already has a snapshot."""
        self._unpend(slot)
        if page_hash in self._by_hash:
            self._free.append(slot)
            return False
        self._by_hash[page_hash] = slot
        self._by_slot[slot] = page_hash
        self._lru[slot] = None
        return True

    def release(self, slot: int) -> None:
        """A pending snapshot that will not be committed (its step failed, its page was not
        indexed): the slot is free again."""
        self._unpend(slot)
        self._free.append(slot)

    def forget(self, page_hash: PageHash) -> None:
        """The page that ends at this snapshot left the KV index: no hit can reach it any more."""
        slot = self._by_hash.pop(page_hash, None)
        if slot is None:
            return
        del self._by_slot[slot]
        del self._lru[slot]
        self._free.append(slot)

    def _unpend(self, slot: int) -> None:
        if slot not in self._pending:
            raise SnapshotError(slot, "is not pending")
        self._pending.remove(slot)
