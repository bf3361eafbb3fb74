"""BatchScheduler: the one continuous-batching policy every model line uses.

Each step fills a token budget: decode rows first (oldest admission first), then the next chunks
of partially prefilled requests, then new admissions (FCFS, while fewer than `max_num_seqs` run).
A request is admitted only when every KV group can hold its first chunk. When a running request
cannot get its next page, the most recently admitted request is preempted by recompute (its full
pages stay in the prefix cache) and returns to the front of the queue; the oldest request always
makes progress, and one that could never fit alone is rejected (`kv_budget`) before admission.
Every fact goes through the `RequestLedger`; the `ModelRunner` only sees rows.

A model with recurrent state (`state_slots`, engine/kv/state_pool.py) also needs one state slot
per running request: admission takes it together with the pages (all or none), and finish, abort
and preemption give it back. Its state is only valid at the request's own frontier, so prefix
caching needs state snapshots (engine/kv/snapshots.py, `snapshot_slots`): a prefill row that ends on
a page boundary copies its slot into a snapshot after the forward (`StepBatch.snapshot_state`), and
a hit stops at the deepest boundary with a snapshot, copied into the new slot before the forward
(`StepBatch.restore_state`). To give every prompt a snapshot where a later hit can use it, the last
prefill chunk stops at the deepest page boundary a resend could resume from (`_snapshot_chunk`).
Overlapped prefill is refused for such a model; async scheduling serves it (below).

Overlapped prefill (`async_prefill`; docs/engine.md tells how and why): prefill work goes into one
side forward at a time, joined at a later step. Until the join its requests hold their pages, get
no row, are never preempted and release no window; an abort retires one at once but frees its
pages only at the join, when the forward can no longer touch them.

Async scheduling (`async_scheduling`; docs/engine.md): a step schedules and launches step N+1
before it reads step N's tokens, then applies N's. A decode row whose last token is still on the
device is fed from N's sampled ids there (`BatchRow.feed_from`); a request that N's token will
finish by length gets no row; one that N finishes on a stop token wastes its row in N+1, whose
token is dropped. Facts still go to the ledger once, when N is collected. A request finished or
failed while a launched step still holds its row frees its pages only when the last such step is
collected; an abort frees them at once, after waiting on the device (not collecting) for the launched
step that holds its row. A step that would preempt first collects N (drains the pipeline), so a
preempted request never has a row in flight.

With recurrent state, a state slot follows the pages' rules: taken with them at admission, given
back with them. A launched step carries its state copies (restores before its forward, snapshots
after it). A snapshot slot it writes stays pending until that step is collected: then it is committed (the request still runs and
its page is indexed) or released (the request was retired meanwhile), and a failed launch releases
it. A snapshot is findable, so restorable, only once the step that wrote it has been collected, so
every restore reads a copy queued in an earlier step. Every copy into or out of a snapshot slot is
queued on the runner's one stream in the order the host hands the slot out, so the host may hand a
committed slot to a new snapshot (LRU eviction, `SnapshotCache.take`) or free it (`forget`) while a
launched step still restores from it: that step's read is queued before the new owner's write,
which only a later launched step (or the same step, after its forward) makes. No copy queued
earlier can land after a later one, so no snapshot's content is clobbered out of order.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum

from engine.config import EngineConfig
from engine.contract import (
    ContractError,
    FinishReason,
    Load,
    RejectReason,
    Request,
    StepOutputs,
    TokenLogprob,
)
from engine.kv import KVGroupSpec, KVManager
from engine.kv.snapshots import SnapshotCache
from engine.kv.state_pool import PADDING_SLOT, SlotPool
from engine.ledger import RequestLedger
from engine.runner import (
    FED_TOKEN,
    BatchRow,
    ModelRunner,
    PrefillHandle,
    SampledToken,
    StepBatch,
    StepHandle,
    launch_prefill,
    launch_step,
)
from kernels.kv_layout import PAGE_SIZE


class RunnerContractError(RuntimeError):
    """The model runner answered a batch with the wrong shape of result."""


class _Where(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True, eq=False)
class _Seq:
    request: Request
    # Prompt plus committed generated tokens; the last one is not yet computed while decoding.
    tokens: list[int]
    num_prompt: int
    # The token count (prompt plus generated) that finishes it by length: the prompt plus
    # max_tokens, or the model's context length if that comes first.
    length_limit: int
    where: _Where = _Where.WAITING
    # Positions whose KV is written.
    num_computed: int = 0
    admitted: bool = False
    # Checked once against the context length, vocabulary and KV capacity (none of which change).
    vetted: bool = False
    # Monotonic admission stamp (re-stamped on re-admission): preemption takes the largest first.
    admit_order: int = 0
    # A row of the side prefill forward still in flight: its pages may be read or written.
    in_flight: bool = False
    # The state slot held while running (recurrent models); the padding slot otherwise.
    slot: int = PADDING_SLOT
    # Async scheduling: tokens sampled by launched steps and not yet applied (not in `tokens`), and
    # rows in launched steps not yet collected (its pages may still be read or written).
    pending: int = 0
    launched_rows: int = 0
    # Its row in the latest launched step, while that row's token is in flight (`pending`): what
    # the next step's row of it is fed from. Only that step can be in flight when the next is built.
    fed_by_row: int = 0
    # A state snapshot its row in the step being run writes: (the row's end position, the slot).
    snapshot: tuple[int, int] | None = None
    # Every launched step holding a row of it has finished on the device (an abort waited for
    # them): its pages and slot are freed at once, not when those steps are collected.
    device_done: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, those still on the device included."""
        return len(self.tokens) + self.pending

    @property
    def num_generated(self) -> int:
        """Generated tokens, those still on the device included (the next row's sampling step)."""
        return self.num_tokens - self.num_prompt

    @property
    def decoding(self) -> bool:
        """It has generated a token and every position but the last token's is computed."""
        # `num_tokens`, spelled out: this is read for every running request in every step.
        num_tokens = len(self.tokens) + self.pending
        return num_tokens > self.num_prompt and self.num_computed == num_tokens - 1


@dataclass(slots=True)
class OverlapStats:
    """What overlapped prefill did, counted since start-up (all zero when it is off)."""

    # Side prefill forwards launched, and joined.
    launches: int = 0
    joins: int = 0
    # Steps whose decode rows ran while a side prefill forward was in flight (not yet joined).
    overlapped_decode_steps: int = 0
    # Of those, the steps after whose decode the side forward's kernels were still running: the
    # device really ran both at once. Always 0 where the launch runs synchronously (CPU, sim).
    still_running_after_decode: int = 0
    # Requests retired while in flight, whose pages were freed only at the join.
    deferred_frees: int = 0


@dataclass(slots=True)
class AsyncStats:
    """What async scheduling did, counted since start-up (all zero when it is off)."""

    # Steps launched, and collected.
    launches: int = 0
    collects: int = 0
    # Launches made while the step before them was still running (`done()` false): host work that
    # overlapped the device. Always 0 where a launch runs to completion at once (CPU, sim).
    launched_while_running: int = 0
    # Rows fed on the device from the previous step's sampled ids.
    fed_rows: int = 0
    # Rows whose request finished or was retired before their step was collected: their tokens
    # were dropped.
    wasted_rows: int = 0
    # Steps that collected the step in flight before scheduling, because they had to preempt.
    drains: int = 0
    # Requests retired with a row in flight, whose pages (and state slot) were freed only at its
    # collection.
    deferred_frees: int = 0


class _DrainFirst(Exception):
    """Raised inside scheduling: this step must preempt, so the step in flight is collected first."""


@dataclass(slots=True, eq=False)
class _Launched:
    """A step launched under async scheduling and not yet collected."""

    handle: StepHandle
    seqs: list[_Seq]
    rows: tuple[BatchRow, ...]
    collected: bool = False
    # The snapshots its rows write after the forward, pending until it is collected: (row index,
    # the row's end position, the snapshot slot).
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _SidePrefill:
    handle: PrefillHandle
    seqs: list[_Seq]
    rows: tuple[BatchRow, ...]
    launched_at_step: int


class BatchScheduler:
    """Implements `engine.contract.Scheduler` over a `ModelRunner`. All methods run on the driver
    thread. `model_id` salts the prefix cache's hash chain so two models never share KV."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        kv_groups: Sequence[KVGroupSpec],
        eos_token_ids: Collection[int],
        max_model_len: int,
        *,
        model_id: str,
        vocab_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        state_slots: int | None = None,
        snapshot_slots: int = 0,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len!r}: must be at least 1")
        # `state_slots`: the running requests' slot count, padding slot included (None: no state);
        # `snapshot_slots`: the state snapshots after them, ids [state_slots, + snapshot_slots).
        self._slots = None if state_slots is None else SlotPool(state_slots)
        snapshots: SnapshotCache | None = None
        if self._slots is not None and config.enable_prefix_caching:
            if snapshot_slots < 1:
                raise ContractError(
                    "enable_prefix_caching",
                    True,
                    "a model with recurrent state cannot reuse KV pages alone: it needs state snapshot slots",
                )
            assert state_slots is not None
            snapshots = SnapshotCache(range(state_slots, state_slots + snapshot_slots))
        # Recurrent state with prefix caching: snapshots at page boundaries, chunks cut to them.
        self._snapshots = snapshots
        if self._slots is not None and config.async_prefill:
            raise ContractError("async_prefill", True, "not supported for a model with recurrent state")
        if config.async_prefill and config.async_scheduling:
            raise ContractError(
                "async_scheduling", True, "cannot be combined with async_prefill (one of the two at a time)"
            )
        self._runner = runner
        self._config = config
        self._eos = frozenset(eos_token_ids)
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._clock = clock
        self.kv = KVManager(kv_groups, model_id, config.enable_prefix_caching, snapshots)
        self._ledger = RequestLedger()
        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        # In admission order: preemption pops from the end.
        self._running: list[_Seq] = []
        self._admit_counter = 0
        # The requests that have a row in the step being built or run, for `fail_step`.
        self._in_step: list[_Seq] = []
        self.num_preemptions = 0
        # Overlapped prefill: the side forward in flight, if any.
        self._side: _SidePrefill | None = None
        self._step_index = 0
        self.prefill_overlap = OverlapStats()
        # Async scheduling: the step launched and not yet collected, and the one being collected.
        self._pending: _Launched | None = None
        self._collecting: _Launched | None = None
        self.async_stats = AsyncStats()
        # The step being built: state copies before its forward (hits) and after it (snapshots).
        self._restores: list[tuple[int, int]] = []
        self._snapshot_copies: list[tuple[int, int]] = []

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    @property
    def config(self) -> EngineConfig:
        return self._config

    def prefilling_count(self) -> int:
        """Running requests whose prompt (or recompute) is not fully computed yet."""
        return sum(1 for seq in self._running if not seq.decoding)

    # -- Scheduler protocol --------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        self._ledger.open(request)
        num_prompt = len(request.prompt_token_ids)
        length_limit = min(num_prompt + request.sampling.max_tokens, self._max_model_len)
        seq = _Seq(request, list(request.prompt_token_ids), num_prompt, length_limit)
        self._seqs[request.request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str) -> None:
        self._ledger.abort(request_id)
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        if seq.launched_rows:
            # An abort frees the request's pages and slot at once (the step contract): the launched
            # step holding its row is waited for on the device, not collected (its tokens are
            # applied in turn, this request's dropped), so nothing still writes them.
            assert self._pending is not None, f"{request_id} has a launched row but no step is in flight"
            self._pending.handle.wait()
            seq.device_done = True
        self._retire(seq)

    def has_work(self) -> bool:
        # A side forward in flight is work even when every request in it was aborted: its pages
        # are freed only when it is joined.
        # So is a launched step: its tokens are still to be applied, and it may hold the pages of
        # requests already retired.
        return (
            bool(self._waiting) or bool(self._running) or self._side is not None or self._pending is not None
        )

    def prefill_in_flight(self) -> tuple[str, ...]:
        """Ids of the requests whose side prefill forward has not been joined yet (aborted ones
        included: they still hold their pages)."""
        return () if self._side is None else tuple(s.request_id for s in self._side.seqs)

    def load(self) -> Load:
        groups = self.kv.load()
        slots = self._slots
        return Load(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_pages_used=sum(g.pages_used for g in groups),
            kv_pages_total=sum(g.pages_total for g in groups),
            groups=groups,
            state_slots_used=0 if slots is None else slots.used,
            state_slots_total=0 if slots is None else slots.total,
        )

    def step(self) -> StepOutputs:
        self._in_step = []
        self._step_index += 1
        if self._config.async_prefill:
            self._step_overlapped()
        elif self._config.async_scheduling_enabled:
            self._step_pipelined()
        else:
            rows = self._schedule()
            if rows:
                batch = StepBatch(tuple(rows), tuple(self._restores), tuple(self._snapshot_copies))
                self._restores.clear()
                self._snapshot_copies.clear()
                results = self._runner.execute(batch)
                self._apply(self._in_step, rows, results)
        self._in_step = []
        return self._ledger.drain()

    def fail_step(self, message: str) -> StepOutputs:
        # Under async scheduling the step may have launched one step and been collecting another:
        # both are waited for (their rows may still touch pages) and their requests fail too.
        for launch in (self._collecting, self._pending):
            if launch is not None:
                self._abandon(launch)
                self._in_step.extend(launch.seqs)
        self._collecting = self._pending = None
        self._restores.clear()
        self._snapshot_copies.clear()
        for seq in self._in_step:
            if seq.where is not _Where.DONE:
                self._retire(seq)
                self._ledger.fail(seq.request_id, message)
        # A step may have raised after finishing some of its requests, before its sweep.
        self._running = [s for s in self._running if s.where is _Where.RUNNING]
        self._in_step = []
        return self._ledger.drain()

    # -- scheduling ----------------------------------------------------------------------------

    def _schedule(self) -> list[BatchRow]:
        rows: list[BatchRow] = []
        scheduled: set[int] = set()  # ids of _Seq objects with a row this step
        budget, preempted = self._schedule_decodes(rows, scheduled, self._config.max_num_batched_tokens)
        self._schedule_prefills(rows, scheduled, budget, preempted)
        return rows

    def _schedule_decodes(self, rows: list[BatchRow], scheduled: set[int], budget: int) -> tuple[int, bool]:
        """Decode rows, oldest first. Returns (budget left, whether anything was preempted)."""
        return self._schedule_running(rows, scheduled, budget, decodes=True)

    def _schedule_running(
        self, rows: list[BatchRow], scheduled: set[int], budget: int, *, decodes: bool
    ) -> tuple[int, bool]:
        """Rows for running requests, oldest first: their decode tokens (`decodes`) or their next
        prefill chunks. Returns (budget left, whether anything was preempted)."""
        preempted = False
        running = self._running
        # Iterate by index: preemption shortens the list's tail.
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            i += 1
            # Scheduled first: the prefill pass then skips the step's decode rows at one lookup each.
            if id(seq) in scheduled or seq.decoding != decodes:
                continue
            if decodes and seq.pending and len(seq.tokens) + seq.pending >= seq.length_limit:
                continue  # the token in flight is its last: it finishes when that step is collected
            # A decode needs its one token and may preempt itself (it is then the newest). A
            # prefill chunk shrinks to what fits, and one that finds no page waits instead of
            # preempting itself: the rows already scheduled will free or give up pages.
            want = 1 if decodes else self._snapshot_chunk(seq, seq.num_computed, budget)
            if self._take_free_pages(seq, want):
                granted = want  # the common case: the pages are there (or free)
            else:
                granted, did_preempt = self._reserve(seq, want, scheduled, may_preempt_self=decodes)
                preempted |= did_preempt
            if granted == 0:
                # A decode that preempted itself, or whose only pages to take are an in-flight
                # prefill's (it waits for the join); a prefill with no page to take.
                continue
            rows.append(self._row(seq, granted))
            scheduled.add(id(seq))
            budget -= granted
        return budget, preempted

    def _schedule_prefills(
        self, rows: list[BatchRow], scheduled: set[int], budget: int, preempted: bool
    ) -> None:
        """Next chunks of partial prefills (oldest first), then admissions (FCFS), under `budget`."""
        # `scheduled` holds only requests with a row in this step (an overlapped step seeds it with
        # the side forward's requests only when it schedules no prefill), and a scheduled request
        # is never preempted in its step: when it is as large as the running list, every running
        # request has its row (a decode step's common case) and no chunk is left to find.
        if len(scheduled) < len(self._running):
            budget, chunks_preempted = self._schedule_running(rows, scheduled, budget, decodes=False)
            preempted |= chunks_preempted

        # Admit from the waiting queue, FCFS. Not in a step that preempted: the pages just
        # taken back would be handed straight to a request that lost them a moment ago.
        while (
            not preempted and budget > 0 and self._waiting and len(self._running) < self._config.max_num_seqs
        ):
            seq = self._waiting[0]
            if self._refuse_if_never_fits(seq):
                continue
            granted = self._admit(seq, budget)
            if granted == 0:
                break  # head of line waits for pages; FCFS keeps later ones behind it
            rows.append(self._row(seq, granted))
            scheduled.add(id(seq))
            budget -= granted

    # -- overlapped prefill --------------------------------------------------------------------

    def _step_overlapped(self) -> None:
        # Join a side forward of an earlier step as soon as it is done, or wait for it when no
        # decode row could run beside it.
        side = self._side
        if (
            side is not None
            and side.launched_at_step < self._step_index
            and (side.handle.done() or not self._any_decoding())
        ):
            self._join()
        # Requests of a side forward still in flight get no row and are never preempted.
        scheduled = {id(s) for s in self._side.seqs} if self._side is not None else set()
        decode_rows: list[BatchRow] = []
        # `_row` appends to `_in_step` (which may already hold the joined requests) in row order.
        first_decode = len(self._in_step)
        _, preempted = self._schedule_decodes(decode_rows, scheduled, self._config.max_num_batched_tokens)
        decode_seqs = self._in_step[first_decode:]
        if self._side is None:
            prefill_rows: list[BatchRow] = []
            self._schedule_prefills(prefill_rows, scheduled, self._config.max_num_batched_tokens, preempted)
            if prefill_rows:
                self._launch(prefill_rows, self._in_step[first_decode + len(decode_seqs) :])
        if decode_rows:
            results = self._runner.execute(StepBatch(tuple(decode_rows)))
            if self._side is not None:
                self.prefill_overlap.overlapped_decode_steps += 1
                if not self._side.handle.done():
                    self.prefill_overlap.still_running_after_decode += 1
            self._apply(decode_seqs, decode_rows, results)
        elif self._side_launched_before():
            # Nothing ran on the main stream (every decode row waits for pages): wait, don't spin.
            self._join()

    def _side_launched_before(self) -> bool:
        """A side forward is in flight and was launched in an earlier step (never joined in its own)."""
        return self._side is not None and self._side.launched_at_step < self._step_index

    def _any_decoding(self) -> bool:
        return any(s.decoding and not s.in_flight for s in self._running)

    def _launch(self, rows: list[BatchRow], seqs: list[_Seq]) -> None:
        # If the launch raises, nothing is left running (the runner's contract): `fail_step` may
        # free these requests' pages at once, as they were never marked in flight.
        handle = launch_prefill(self._runner, StepBatch(tuple(rows)))
        for seq in seqs:
            seq.in_flight = True
        self._side = _SidePrefill(handle, list(seqs), tuple(rows), self._step_index)
        self.prefill_overlap.launches += 1

    def _join(self) -> None:
        """Collect the side forward (waiting for it if needed) and apply its rows, as a step would."""
        side = self._side
        assert side is not None
        self._side = None
        live = [(s, r) for s, r in zip(side.seqs, side.rows, strict=True) if s.where is _Where.RUNNING]
        # From here a failure (in sampling, say) fails these requests through `fail_step`.
        self._in_step.extend(s for s, _ in live)
        try:
            results = side.handle.collect()
        finally:
            # collect returns or raises only once the forward is over: its pages are safe to free.
            for seq in side.seqs:
                seq.in_flight = False
                if seq.where is _Where.DONE:
                    self.kv.free(seq.request_id)
                    self.prefill_overlap.deferred_frees += 1
        self.prefill_overlap.joins += 1
        if len(results) != len(side.rows):
            raise RunnerContractError(
                f"runner returned {len(results)} results for {len(side.rows)} prefill rows"
            )
        by_seq = {id(s): res for s, res in zip(side.seqs, results, strict=True)}
        self._apply([s for s, _ in live], [r for _, r in live], [by_seq[id(s)] for s, _ in live])

    # -- async scheduling -----------------------------------------------------------------------

    def _step_pipelined(self) -> None:
        """Schedule and launch this step, then collect the one launched before it."""
        previous = self._pending
        first = 0
        try:
            rows = self._schedule()
        except _DrainFirst:
            # Nothing was admitted or preempted before the raise (admissions follow every row that
            # may preempt), so no restore was queued; the rows built so far only hold pages they keep
            # after the drain, and the snapshots they took are given back.
            assert not self._restores
            for seq in self._in_step:
                if seq.snapshot is not None:
                    assert self._snapshots is not None
                    self._snapshots.release(seq.snapshot[1])
                    seq.snapshot = None
            self._snapshot_copies.clear()
            self._in_step = []
            assert previous is not None
            self._pending = None
            self._collect(previous)
            previous = None
            self.async_stats.drains += 1
            # `_in_step` now holds the collected step's requests too (for `fail_step`).
            first = len(self._in_step)
            rows = self._schedule()
        if rows:
            self._launch_step(rows, self._in_step[first:], previous)
        else:
            self._pending = None
        if previous is not None:
            self._collect(previous)

    def _launch_step(self, rows: list[BatchRow], seqs: list[_Seq], previous: _Launched | None) -> None:
        feed = previous.handle if previous is not None else None
        running_before = feed is not None and not feed.done()
        # If the launch raises, nothing it started is running (the runner's contract): the
        # requests' own `snapshot` fields still name the slots taken, which `fail_step` releases.
        batch = StepBatch(tuple(rows), tuple(self._restores), tuple(self._snapshot_copies))
        self._restores.clear()
        self._snapshot_copies.clear()
        handle = launch_step(self._runner, batch, feed)
        fed_rows = 0
        for i, (seq, row) in enumerate(zip(seqs, rows, strict=True)):
            seq.launched_rows += 1
            # The next step schedules from here: this row's KV is being written.
            seq.num_computed = row.end_pos
            if row.sample:
                seq.pending += 1
                seq.fed_by_row = i
            if row.feed_from is not None:
                fed_rows += 1
        self.async_stats.fed_rows += fed_rows
        launched = _Launched(handle, seqs, batch.rows)
        if batch.snapshot_state:
            # The launch owns them now: a second chunk of the same request may take another before
            # this one is collected.
            for i, seq in enumerate(seqs):
                if seq.snapshot is not None:
                    end, slot = seq.snapshot
                    seq.snapshot = None
                    launched.snapshots.append((i, end, slot))
        self._pending = launched
        self.async_stats.launches += 1
        self.async_stats.launched_while_running += running_before

    def _collect(self, launch: _Launched) -> None:
        """Wait for a launched step's tokens and apply them, as a synchronous step would."""
        self._collecting = launch
        # From here a failure (in sampling, say) fails these requests through `fail_step`.
        self._in_step.extend([s for s in launch.seqs if s.where is _Where.RUNNING])
        launch.collected = True
        results = launch.handle.collect()
        self._collecting = None
        self.async_stats.collects += 1
        self._land(launch)
        if len(results) != len(launch.rows):
            self._drop_snapshots(launch)
            raise RunnerContractError(f"runner returned {len(results)} results for {len(launch.rows)} rows")
        if launch.snapshots:
            self._settle_snapshots(launch)
        finished = False
        computed = self.kv.computed
        for seq, row, result in zip(launch.seqs, launch.rows, results, strict=True):
            if seq.where is not _Where.RUNNING:
                # Retired before its step was read (a stop token in the step before, an abort):
                # the row was wasted. Preemption drains first, so no request here is waiting.
                assert seq.where is _Where.DONE, f"{seq.request_id!r} was preempted with a row in flight"
                self.async_stats.wasted_rows += 1
                continue
            computed(row.request_id, seq.tokens, row.end_pos)
            if not row.sample:
                continue
            if result is None:
                raise RunnerContractError(f"row of {row.request_id!r} asked for a token and got None")
            finished |= self._take_token(seq, result)
        if finished:
            self._running = [s for s in self._running if s.where is _Where.RUNNING]

    def _settle_snapshots(self, launch: _Launched) -> None:
        """The collected launch wrote its snapshots: findable for the requests still running (once
        their pages are indexed), given back for those retired meanwhile."""
        snapshots = self._snapshots
        assert snapshots is not None
        kv = self.kv
        for i, end, slot in launch.snapshots:
            seq = launch.seqs[i]
            if seq.where is _Where.RUNNING:
                kv.computed(seq.request_id, seq.tokens, end)
                kv.commit_snapshot(seq.request_id, end, slot)
            else:
                snapshots.release(slot)
        launch.snapshots.clear()

    def _drop_snapshots(self, launch: _Launched) -> None:
        """A launch that failed or was abandoned: what its snapshot slots hold is unknown."""
        if launch.snapshots:
            assert self._snapshots is not None
            for _, _, slot in launch.snapshots:
                self._snapshots.release(slot)
            launch.snapshots.clear()

    def _land(self, launch: _Launched) -> None:
        """The launch is over on the device: its rows hold no pages any more, and the pages of
        requests retired meanwhile, once no other launch holds a row of theirs, are freed."""
        for seq, row in zip(launch.seqs, launch.rows, strict=True):
            seq.launched_rows -= 1
            if row.sample:
                seq.pending -= 1
            if (
                seq.where is _Where.DONE
                and seq.launched_rows == 0
                and not seq.in_flight
                and not seq.device_done
            ):
                self.kv.free(seq.request_id)
                self._release_slot(seq)
                self.async_stats.deferred_frees += 1

    def _abandon(self, launch: _Launched) -> None:
        """After a failure: wait for a launch without applying it, then let go of its rows."""
        if not launch.collected:
            launch.collected = True
            # The step already failed; what matters here is that this launch is over.
            with contextlib.suppress(Exception):
                launch.handle.collect()
        self._land(launch)
        self._drop_snapshots(launch)
        for seq in launch.seqs:
            seq.pending = 0

    def _take_free_pages(self, seq: _Seq, want: int) -> bool:
        """Release what a sliding window no longer sees, then give a running request pages for
        `want` more tokens if they are there or free; False (nothing taken) when they are not."""
        kv = self.kv
        rid = seq.request.request_id
        if kv.has_sliding_window:
            # Under async scheduling this can release pages a step in flight still reads: every
            # later writer of a page runs after that step on the same stream (docs/engine.md).
            kv.release_window(rid, seq.num_computed)
        return kv.allocate(rid, seq.num_computed + want)

    def _reserve(self, seq: _Seq, want: int, scheduled: set[int], may_preempt_self: bool) -> tuple[int, bool]:
        """Pages for up to `want` tokens of a running request whose pages `_take_free_pages` could
        not take, preempting requests admitted after it (newest first, never one already in this
        step) when none fit. Returns (tokens granted, whether anything was preempted); 0 granted
        means the request gets no row this step."""
        rid = seq.request_id
        preempted = False
        while True:
            # A decode needs its one token; a prefill chunk may shrink to what fits.
            fit = self.kv.fit(rid, seq.num_computed, want)
            if fit > 0:
                if not self.kv.allocate(rid, seq.num_computed + fit):
                    raise AssertionError(f"request {rid!r}: {fit} tokens fit but allocation failed")
                return fit, preempted
            victim = self._running[-1]
            if id(victim) in scheduled or victim.admit_order < seq.admit_order:
                return 0, preempted
            if victim is seq and not may_preempt_self:
                return 0, preempted
            if self._pending is not None:
                raise _DrainFirst
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return 0, preempted

    def _preempt(self, seq: _Seq) -> None:
        # Async scheduling collects the step in flight before it preempts (`_DrainFirst`).
        assert seq.pending == 0 and seq.launched_rows == 0, (
            f"preempting {seq.request_id!r} with a row in flight"
        )
        self._running.remove(seq)
        self.kv.free(seq.request_id, keep_hashes=True)
        self._release_slot(seq)
        seq.num_computed = 0
        seq.where = _Where.WAITING
        self._waiting.appendleft(seq)
        self.num_preemptions += 1

    def _refuse_if_never_fits(self, seq: _Seq) -> bool:
        """Reject the waiting head if it can never run; True when it was rejected."""
        request = seq.request
        if seq.vetted:
            return False
        rid = request.request_id
        total = seq.num_prompt + request.sampling.max_tokens
        reason: RejectReason | None = None
        message = ""
        if total > self._max_model_len:
            reason = RejectReason.CONTEXT_LENGTH
            message = (
                f"prompt ({seq.num_prompt} tokens) plus max_tokens ({request.sampling.max_tokens}) "
                f"is {total}, over the model's maximum context length of {self._max_model_len}"
            )
        elif self._vocab_size is not None and any(
            t < 0 or t >= self._vocab_size for t in request.prompt_token_ids
        ):
            bad = next(t for t in request.prompt_token_ids if t < 0 or t >= self._vocab_size)
            reason = RejectReason.INVALID_INPUT
            message = f"prompt token id {bad} is outside the vocabulary (0..{self._vocab_size - 1})"
        elif self._slots is not None and self._slots.total == 0:
            reason = RejectReason.KV_BUDGET
            message = "request needs a state slot but the state pool holds none"
        else:
            # The last sampled token is never fed back, so its KV is never written.
            short = self.kv.shortfall(total - 1, self._config.max_num_batched_tokens)
            if short is not None:
                reason = RejectReason.KV_BUDGET
                message = (
                    f"request needs {short.needed} KV pages in group {short.group!r} but the cache "
                    f"holds only {short.total}"
                )
        if reason is None:
            seq.vetted = True
            return False
        self._waiting.popleft()
        self._forget(seq)
        self._ledger.reject(rid, reason, message)
        return True

    def _admit(self, seq: _Seq, budget: int) -> int:
        """Move the waiting head to running with pages for its first chunk; 0 if they don't fit."""
        rid = seq.request_id
        hit = self.kv.prefix_hit(rid, seq.tokens)
        chunk = self._snapshot_chunk(seq, hit, budget)
        slot = PADDING_SLOT
        if self._slots is not None:
            taken = self._slots.take()
            if taken is None:
                self.kv.free(rid, keep_hashes=True)
                return 0  # every slot is held: wait for a finish, as for pages
            slot = taken
        if not self.kv.allocate(rid, hit + chunk):
            self.kv.free(rid, keep_hashes=True)
            if self._slots is not None:
                self._slots.release(slot)
            return 0
        seq.slot = slot
        restore = self.kv.restore_from(rid)
        if restore is not None:
            # The hit resumes from the snapshot's state: into the request's slot before the forward.
            self._restores.append((restore, slot))
        self._waiting.popleft()
        seq.num_computed = hit
        seq.where = _Where.RUNNING
        self._admit_counter += 1
        seq.admit_order = self._admit_counter
        self._running.append(seq)
        if not seq.admitted:
            seq.admitted = True
            self._ledger.admit(rid, self._clock())
            self._ledger.record_cached(rid, hit)
        return chunk

    def _snapshot_chunk(self, seq: _Seq, start: int, budget: int) -> int:
        """How many prompt (or recompute) tokens from `start` the next prefill chunk takes: what is
        left, at most `budget`. With state snapshots the last chunk of a sequence of L tokens stops
        at (L − 1) // page · page, the deepest boundary from which a later request with the same
        tokens can resume (a hit leaves at least one token to compute), and the tail of at most one
        page runs as its own chunk: the state there is snapshotted for free after the forward.
        Other chunks are left as the budget cuts them (they snapshot when they end on a boundary),
        so chunked prefill keeps its boundaries."""
        length = len(seq.tokens)
        end = min(length, start + budget)
        if self._snapshots is not None and end == length:
            boundary = (length - 1) // PAGE_SIZE * PAGE_SIZE
            if start < boundary:
                end = boundary
        return end - start

    def _row(self, seq: _Seq, num_tokens: int) -> BatchRow:
        request = seq.request
        tokens = seq.tokens
        start = seq.num_computed
        end = start + num_tokens
        seq_tokens = len(tokens) + seq.pending
        if self._snapshots is not None and not seq.decoding and end % PAGE_SIZE == 0:
            snapshot = self.kv.take_snapshot(request.request_id, tokens, end)
            if snapshot is not None:
                seq.snapshot = (end, snapshot)
                self._snapshot_copies.append((seq.slot, snapshot))
        self._in_step.append(seq)
        feed_from: int | None = None
        if seq.pending:
            # Only a decode row has a token in flight: its one token, sampled by the step in flight.
            assert self._pending is not None and num_tokens == 1 and end == seq_tokens
            feed_from = seq.fed_by_row
            token_ids: tuple[int, ...] = (FED_TOKEN,)
        elif num_tokens == 1:
            token_ids = (tokens[start],)
        else:
            token_ids = tuple(tokens[start:end])
        # Positional: built once per row per step, and a dataclass's keyword call costs 2.5× a
        # positional one (docs/benchmarks/host-cpu.md).
        return BatchRow(
            request.request_id,
            token_ids,
            start,  # start_pos
            self.kv.page_tables(request.request_id, end),
            end == seq_tokens,  # sample
            request.sampling,
            # context: the live token list, not a copy (a copy per row per step would cost O(total
            # tokens)): valid while the step runs; a runner must not keep it.
            tokens,
            seq_tokens - seq.num_prompt,  # num_generated
            seq.slot,  # state_slot
            feed_from,
        )

    # -- applying a step's results -------------------------------------------------------------

    def _apply(
        self, seqs: Sequence[_Seq], rows: Sequence[BatchRow], results: Sequence[SampledToken | None]
    ) -> None:
        if len(results) != len(rows):
            raise RunnerContractError(f"runner returned {len(results)} results for {len(rows)} rows")
        finished = False
        computed = self.kv.computed
        for seq, row, result in zip(seqs, rows, results, strict=True):
            seq.num_computed = row.end_pos
            computed(seq.request.request_id, seq.tokens, seq.num_computed)
            if seq.snapshot is not None:
                end, slot = seq.snapshot
                seq.snapshot = None
                self.kv.commit_snapshot(seq.request_id, end, slot)
            if not row.sample:
                continue
            if result is None:
                raise RunnerContractError(f"row of {row.request_id!r} asked for a token and got None")
            finished |= self._take_token(seq, result)
        if finished:
            self._running = [s for s in self._running if s.where is _Where.RUNNING]

    def _take_token(self, seq: _Seq, sampled: SampledToken) -> bool:
        """Commit one sampled token or finish on it; True when the request finished."""
        sampling = seq.request.sampling
        token = sampled.token_id
        if token in self._eos and not sampling.ignore_eos:
            self._finish(seq, FinishReason.STOP)
            return True
        logprobs: tuple[TokenLogprob, ...] | None = None
        if sampling.logprobs is not None and sampled.logprob is not None:
            logprobs = (sampled.logprob,)
        self._ledger.commit(seq.request.request_id, (token,), logprobs)
        tokens = seq.tokens
        tokens.append(token)
        # Committed tokens only: under async scheduling a later step's token may be in flight.
        if len(tokens) >= seq.length_limit:
            self._finish(seq, FinishReason.LENGTH)
            return True
        return False

    def _finish(self, seq: _Seq, reason: FinishReason) -> None:
        self._ledger.finish(seq.request_id, reason)
        # The running list is swept once at the end of the step, not once per finish.
        self._forget(seq)

    def _retire(self, seq: _Seq) -> None:
        """Take a request out of its queue and free its pages now (abort, failure)."""
        if seq.where is _Where.WAITING:
            self._waiting.remove(seq)
        elif seq.where is _Where.RUNNING:
            self._running.remove(seq)
        self._forget(seq)

    def _forget(self, seq: _Seq) -> None:
        self._seqs.pop(seq.request_id, None)
        seq.where = _Where.DONE
        if seq.snapshot is not None:
            # Its step failed before the snapshot was committed (or launched: a launched step's
            # snapshots are the launch's): what the slot holds is unknown.
            assert self._snapshots is not None
            self._snapshots.release(seq.snapshot[1])
            seq.snapshot = None
        if seq.in_flight or (seq.launched_rows and not seq.device_done):
            return  # a forward in flight may still touch its pages: `_join` or `_land` frees them
        self.kv.free(seq.request_id)
        self._release_slot(seq)

    def _release_slot(self, seq: _Seq) -> None:
        if self._slots is not None and seq.slot != PADDING_SLOT:
            self._slots.release(seq.slot)
        seq.slot = PADDING_SLOT
