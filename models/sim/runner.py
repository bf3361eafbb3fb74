"""SimRunner: a fake model with real paged KV.

Its "KV" is one 64-bit digest per position per group (see `rule.advance`), written into the pages
the scheduler hands it and read back through the page tables, so the next token depends on the
history only through the KV. A wrong page table, a page shared while still being written, a freed
page read later or a window released too early changes the tokens or raises `SimKVError`, which
is what makes the sim a test of the engine and not just of itself.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence

from engine.kv import KVGroupSpec
from engine.runner import BatchRow, SampledToken, StepBatch
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE
from models.sim.rule import INITIAL_STATE, advance, draw

FaultHook = Callable[[StepBatch], None]


class SimKVError(RuntimeError):
    """The scheduler gave the sim a page table that cannot be right."""

    def __init__(self, request_id: str, group: str, position: int, why: str) -> None:
        super().__init__(f"request {request_id!r}, group {group!r}, position {position}: {why}")
        self.request_id = request_id
        self.group = group
        self.position = position


class SimRunner:
    def __init__(
        self,
        groups: Sequence[KVGroupSpec],
        step_delay_s: float = 0.0,
        fault: FaultHook | None = None,
    ) -> None:
        if step_delay_s < 0:
            raise ValueError(f"step_delay_s={step_delay_s!r}: must be >= 0")
        self._groups = tuple(groups)
        self._stores = [array("Q", bytes(8 * g.num_pages * PAGE_SIZE)) for g in self._groups]
        full = [i for i, g in enumerate(self._groups) if g.sliding_window is None]
        # The group the history is read from: a full one when there is one.
        self._primary = full[0] if full else 0
        if not full and (self._groups[0].sliding_window or 0) < 2:
            raise ValueError("a sim with only sliding groups needs a window of at least 2")
        self.step_delay_s = step_delay_s
        self.fault = fault
        self.steps = 0
        self.tokens_computed = 0

    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        if self.fault is not None:
            self.fault(batch)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out: list[SampledToken | None] = []
        for row in batch.rows:
            state = self._history(row)
            for offset, token in enumerate(row.token_ids):
                state = advance(state, token)
                self._write(row, row.start_pos + offset, state)
            out.append(draw(state, row.sampling) if row.sample else None)
            self.tokens_computed += len(row.token_ids)
        self.steps += 1
        return out

    # -- the paged store -----------------------------------------------------------------------

    def _slot(self, row: BatchRow, group: int, position: int) -> int:
        spec = self._groups[group]
        table = row.page_tables[group]
        index = position // PAGE_SIZE
        if index >= len(table):
            raise SimKVError(row.request_id, spec.name, position, f"page table has only {len(table)} pages")
        page = table[index]
        if page == PADDING_PAGE:
            raise SimKVError(row.request_id, spec.name, position, "lies on the padding page")
        return page * PAGE_SIZE + position % PAGE_SIZE

    def _read(self, row: BatchRow, group: int, position: int) -> int:
        value = self._stores[group][self._slot(row, group, position)]
        if value == 0:
            raise SimKVError(row.request_id, self._groups[group].name, position, "was never written")
        return value

    def _write(self, row: BatchRow, position: int, state: int) -> None:
        for group in range(len(self._groups)):
            self._stores[group][self._slot(row, group, position)] = state

    def _history(self, row: BatchRow) -> int:
        """The digest just before the row's first token, read from the KV; every other group must
        agree, and a sliding group must still hold the oldest position its window needs."""
        start = row.start_pos
        if start == 0:
            return INITIAL_STATE
        state = self._read(row, self._primary, start - 1)
        for group, spec in enumerate(self._groups):
            if group == self._primary:
                continue
            window = spec.sliding_window
            positions = [start - 1]
            if window is not None and window < 2:
                positions = []
            if window is not None and self._groups[self._primary].sliding_window is None:
                positions.append(max(0, start - window + 1))
            for position in positions:
                expected = state if position == start - 1 else self._read(row, self._primary, position)
                if self._read(row, group, position) != expected:
                    raise SimKVError(row.request_id, spec.name, position, "holds another sequence's KV")
        return state
