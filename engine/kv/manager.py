"""KVManager: every request's page tables across all KV groups, and the prefix cache.

Admission and growth reserve pages in all groups or in none. Prefix hits are whole pages, capped
so at least one prompt token is still computed (the last token must be run to sample from it, and a
partially reused page would be written while shared).

A hit of h pages resumes computing at position h·page_size, so each group must hold exactly what
that position's attention reads: a full group every page below h, a sliding group only the pages
its window still covers (positions > h·page_size − W); older sliding slots start out released
(the padding page), just as the cold path would have released them by then. Sliding pages enter
the index when they are full and stay cached (evictable) after the window releases them.

A model with recurrent state also needs the state at position h·page_size (engine/kv/snapshots.py):
with a `SnapshotCache`, a hit stops at the deepest page boundary that has a snapshot as well as its
pages, and `restore_from` names the snapshot the request's slot must be filled from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.contract import GroupLoad
from engine.kv.group import KVGroup
from engine.kv.prefix_cache import PageHash, PageHasher
from engine.kv.snapshots import SnapshotCache
from engine.kv.spec import KVGroupSpec
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE


class KVConfigError(ValueError):
    def __init__(self, field_name: str, value: object, why: str) -> None:
        super().__init__(f"{field_name}={value!r}: {why}")
        self.field_name = field_name
        self.value = value


@dataclass(frozen=True, slots=True)
class BudgetShortfall:
    """Why a request can never fit: in `group` it needs `needed` pages but only `total` exist."""

    group: str
    needed: int
    total: int


@dataclass(slots=True)
class _RequestKV:
    # Per group: page ids covering positions [16i, 16i + 16); released sliding slots hold page 0.
    # Every group's table has the same length (pages are taken and dropped in all groups at once).
    tables: list[list[int]]
    # Per group: how many leading slots a sliding window has released.
    released: list[int]
    # The hash chain of the request's token sequence, grown lazily; survives preemption.
    hashes: list[PageHash] = field(default_factory=list)
    # Leading pages already known to the prefix cache (hit, or indexed after being computed).
    num_indexed: int = 0
    # Every group's table as a tuple (what a step's row carries), rebuilt only after a table changes.
    frozen: tuple[tuple[int, ...], ...] | None = None
    # The snapshot slot the latest prefix hit stops at (recurrent models), None without one.
    restore: int | None = None


class KVManager:
    def __init__(
        self,
        specs: Sequence[KVGroupSpec],
        model_id: str,
        enable_prefix_caching: bool = True,
        snapshots: SnapshotCache | None = None,
    ) -> None:
        if not specs:
            raise KVConfigError("kv_groups", specs, "a model needs at least one KV group")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise KVConfigError("kv_groups", names, "group names must be distinct")
        # Recurrent models: a hit needs a state snapshot at its depth, and one goes with its page.
        self.snapshots = snapshots
        self.groups = [KVGroup(s, on_forget=self._page_forgotten) for s in specs]
        self.prefix_caching = enable_prefix_caching
        self._hasher = PageHasher(model_id)
        self._requests: dict[str, _RequestKV] = {}
        self._sliding = [i for i, s in enumerate(specs) if s.sliding_window is not None]
        # Whether `release_window` can release anything: a caller skips it per row when not.
        self.has_sliding_window = bool(self._sliding)

    # -- facts ---------------------------------------------------------------------------------

    def load(self) -> tuple[GroupLoad, ...]:
        return tuple(g.load() for g in self.groups)

    def holds(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        return state is not None and any(state.tables)

    def live_pages(self, request_id: str) -> list[int]:
        """Per group, how many pages the request references now."""
        state = self._requests.get(request_id)
        if state is None:
            return [0] * len(self.groups)
        return [sum(1 for p in t if p != PADDING_PAGE) for t in state.tables]

    def shortfall(self, num_positions: int, max_chunk: int) -> BudgetShortfall | None:
        """The first group in which a request spanning `num_positions` could never fit, alone."""
        for g in self.groups:
            needed = g.spec.max_live_pages(num_positions, max_chunk)
            if needed > g.pool.total:
                return BudgetShortfall(g.spec.name, needed, g.pool.total)
        return None

    def page_tables(self, request_id: str, end_pos: int) -> tuple[tuple[int, ...], ...]:
        """Per group, the page ids covering positions [0, end_pos). Every group's table has the same
        length (allocation grows all of them alike), so the cached tuples serve a row whose end is
        in the last page, the common case, as they are."""
        state = self._requests[request_id]
        frozen = state.frozen
        if frozen is None:
            frozen = state.frozen = tuple(tuple(table) for table in state.tables)
        count = -(-end_pos // PAGE_SIZE)  # pages_for, inlined: once per row per step
        if len(frozen[0]) == count:
            return frozen
        return tuple(table[:count] for table in frozen)

    # -- transitions ---------------------------------------------------------------------------

    def prefix_hit(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Reference the longest cached prefix of whole pages of `token_ids` that every group can
        resume from (see the module doc), leaving at least one token to compute. Returns the number
        of tokens covered. The request must hold no pages."""
        state = self._state(request_id)
        if any(state.tables):
            raise RuntimeError(f"request {request_id!r}: prefix lookup while holding pages")
        if not self.prefix_caching:
            return 0
        ps = PAGE_SIZE
        limit = (len(token_ids) - 1) // ps
        self._hasher.extend(state.hashes, token_ids, limit, ps)
        found = [[g.index.find(state.hashes[i]) for i in range(limit)] for g in self.groups]
        # last_missing[gi][h]: the last slot below h whose page group gi lacks (-1: none).
        last_missing: list[list[int]] = []
        for pages in found:
            marks = [-1]
            for i, page in enumerate(pages):
                marks.append(i if page is None else marks[-1])
            last_missing.append(marks)
        hit = 0
        snapshots = self.snapshots
        restore: int | None = None
        for h in range(limit, 0, -1):
            if all(last_missing[gi][h] < self._first_needed_slot(gi, h) for gi in range(len(self.groups))):
                if snapshots is not None:
                    restore = snapshots.find(state.hashes[h - 1])
                    if restore is None:
                        continue  # pages without the state at their end: look shallower
                    snapshots.touch(restore)
                hit = h
                break
        state.restore = restore
        for gi, (g, pages, table) in enumerate(zip(self.groups, found, state.tables, strict=True)):
            lo = self._first_needed_slot(gi, hit)
            table.extend([PADDING_PAGE] * lo)
            for page in pages[lo:hit]:
                assert page is not None
                g.pool.incref(page)
                table.append(page)
            state.released[gi] = lo
        state.num_indexed = hit
        self._touched(state)
        return hit * ps

    def restore_from(self, request_id: str) -> int | None:
        """The snapshot slot whose state the request's latest prefix hit resumes from (None: no
        hit, or a model without snapshots)."""
        state = self._requests.get(request_id)
        return None if state is None else state.restore

    def take_snapshot(self, request_id: str, token_ids: Sequence[int], end_pos: int) -> int | None:
        """A snapshot slot for the state after positions [0, end_pos) of `token_ids` (end_pos on a
        page boundary), which the current step's row of this request computes; None when that
        prefix already has one, or no slot can be taken. Commit or release it after the step."""
        snapshots = self.snapshots
        if snapshots is None or not self.prefix_caching or end_pos < PAGE_SIZE or end_pos % PAGE_SIZE:
            return None
        state = self._requests[request_id]
        pages = end_pos // PAGE_SIZE
        self._hasher.extend(state.hashes, token_ids, pages, PAGE_SIZE)
        if snapshots.find(state.hashes[pages - 1]) is not None:
            return None
        return snapshots.take()

    def commit_snapshot(self, request_id: str, end_pos: int, slot: int) -> None:
        """The step wrote the state after [0, end_pos) into snapshot `slot` (call after
        `computed`): findable once every group indexes the page ending there, else freed."""
        snapshots = self.snapshots
        assert snapshots is not None
        page_hash = self._requests[request_id].hashes[end_pos // PAGE_SIZE - 1]
        if all(g.index.find(page_hash) is not None for g in self.groups):
            snapshots.commit(slot, page_hash)
        else:
            snapshots.release(slot)

    def _page_forgotten(self, page_hash: PageHash) -> None:
        if self.snapshots is not None:
            self.snapshots.forget(page_hash)

    def _first_needed_slot(self, group: int, num_pages: int) -> int:
        """The first page slot group `group` must hold to compute the token at position
        num_pages·page_size: 0 for a full group, the window's oldest page for a sliding one."""
        window = self.groups[group].spec.sliding_window
        if window is None or num_pages == 0:
            return 0
        return max(0, num_pages * PAGE_SIZE - window + 1) // PAGE_SIZE

    def release_window(self, request_id: str, frontier: int) -> None:
        """Sliding groups: release pages wholly before the window of the token at `frontier`
        (it needs positions > frontier - W), each only once `computed` has indexed it, so that a
        later request can still hit it. Under async scheduling the frontier can run a step ahead of
        what is indexed; with a window no shorter than a chunk the pages it passes were indexed
        already (docs/engine.md)."""
        if not self._sliding:
            return
        state = self._requests.get(request_id)
        if state is None:
            return
        for gi in self._sliding:
            window = self.groups[gi].spec.sliding_window
            assert window is not None
            first_needed = frontier - window + 1
            table = state.tables[gi]
            stop = min(len(table), max(0, first_needed) // PAGE_SIZE)
            if self.prefix_caching:
                stop = min(stop, state.num_indexed)
            start = state.released[gi]
            if stop <= start:
                continue
            group = self.groups[gi]
            for slot in range(start, stop):
                page = table[slot]
                if page != PADDING_PAGE:
                    group.release(page)
                    table[slot] = PADDING_PAGE
            state.released[gi] = stop
            state.frozen = None

    def fit(self, request_id: str, start: int, want: int) -> int:
        """How many of the `want` tokens from position `start` could get pages right now."""
        state = self._state(request_id)
        ps = PAGE_SIZE
        best = want
        for g, table in zip(self.groups, state.tables, strict=True):
            best = min(best, (len(table) + g.pool.available) * ps - start)
        return max(0, best)

    def allocate(self, request_id: str, end_pos: int) -> bool:
        """Give the request pages up to position `end_pos` in every group, or in none."""
        # `_state` and `pages_for`, inlined: once per running request per step (a call costs
        # more than the lookup; docs/benchmarks/host-cpu.md).
        state = self._requests.get(request_id) or self._state(request_id)
        pages = -(-end_pos // PAGE_SIZE)
        # Every group's table has the same length: the common case (a decode inside its last
        # page) is one comparison.
        if len(state.tables[0]) >= pages:
            return True
        needs = [pages - len(t) for t in state.tables]
        if any(n > g.pool.available for g, n in zip(self.groups, needs, strict=True)):
            return False
        for gi, (g, n) in enumerate(zip(self.groups, needs, strict=True)):
            if n > 0:
                state.tables[gi].extend(g.pool.allocate(n))
                state.frozen = None
        return True

    def computed(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """The KV of positions [0, num_computed) is written: index the pages that just became full,
        so later requests may share them (a page is never shared while it is being written)."""
        if not self.prefix_caching:
            return
        state = self._requests[request_id]
        full = num_computed // PAGE_SIZE
        if full <= state.num_indexed:
            return
        self._hasher.extend(state.hashes, token_ids, full, PAGE_SIZE)
        for i in range(state.num_indexed, full):
            page_hash = state.hashes[i]
            for g, table in zip(self.groups, state.tables, strict=True):
                if table[i] != PADDING_PAGE:  # a sliding slot released before it was indexed
                    g.index.insert(page_hash, table[i])
        state.num_indexed = full

    def free(self, request_id: str, keep_hashes: bool = False) -> None:
        """Drop every page the request references; full indexed pages stay cached (evictable).
        `keep_hashes` keeps the request's hash chain for its re-admission after preemption."""
        state = self._requests.get(request_id)
        if state is None:
            return
        for g, table in zip(self.groups, state.tables, strict=True):
            # Tail first, so the LRU evicts a prefix's tail before its head.
            for page in reversed(table):
                if page != PADDING_PAGE:
                    g.release(page)
            table.clear()
        state.restore = None
        if keep_hashes:
            state.released = [0] * len(self.groups)
            state.num_indexed = 0
            self._touched(state)
        else:
            del self._requests[request_id]

    # -- internals -----------------------------------------------------------------------------

    def _state(self, request_id: str) -> _RequestKV:
        state = self._requests.get(request_id)
        if state is None:
            n = len(self.groups)
            state = self._requests[request_id] = _RequestKV(tables=[[] for _ in range(n)], released=[0] * n)
        return state

    @staticmethod
    def _touched(state: _RequestKV) -> None:
        state.frozen = None
