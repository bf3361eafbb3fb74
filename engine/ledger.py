"""RequestLedger: the one place a scheduler records facts about requests.

It enforces the lifecycle — admit or reject once, before anything else; tokens and finish only
after admission; exactly one terminal; nothing after it — and folds the facts of one step into at
most one `RequestUpdate` per request. A violation raises `LifecycleError`: it is a bug in the
scheduler, not a state to carry on from. Token counts in terminals come from the ledger's tally.

A step's update for a request is built in place as its facts arrive (the first fact creates it)
and handed out as it is by `drain`, which starts the next step's set: a decode step's token is one
`RequestUpdate` and nothing more per row (docs/benchmarks/host-cpu.md). Updates come out in the
order of each request's first fact of the step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from engine.contract import (
    Admission,
    Failed,
    Finished,
    FinishReason,
    Rejected,
    RejectReason,
    Request,
    RequestUpdate,
    StepOutputs,
    Terminal,
    TokenLogprob,
)

# How many retired ids the ledger remembers, to name "after terminal" and drop late updates for
# aborted requests; older ids are forgotten so a long-running server does not grow without bound.
_RETIRED_MEMORY = 65536


class LifecycleError(RuntimeError):
    def __init__(self, request_id: str, transition: str, state: str) -> None:
        super().__init__(f"request {request_id!r}: illegal {transition} in state {state}")
        self.request_id = request_id
        self.transition = transition
        self.state = state


class _Phase(Enum):
    PARKED = "parked"
    ADMITTED = "admitted"


@dataclass(slots=True)
class _Entry:
    request: Request
    phase: _Phase = _Phase.PARKED
    prompt_tokens: int = 0
    completion_tokens: int = 0


class RequestLedger:
    def __init__(self) -> None:
        self._open: dict[str, _Entry] = {}
        # This step's update of each request with a fact since the last drain, in first-fact order.
        self._pending: dict[str, RequestUpdate] = {}
        # id -> "finished"/"rejected"/"failed"/"aborted"
        self._retired: OrderedDict[str, str] = OrderedDict()

    # -- queries -------------------------------------------------------------------------------

    def is_open(self, request_id: str) -> bool:
        return request_id in self._open

    def completion_tokens(self, request_id: str) -> int:
        return self._entry(request_id, "completion_tokens").completion_tokens

    def __len__(self) -> int:
        return len(self._open)

    # -- transitions ---------------------------------------------------------------------------

    def open(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._open:
            raise LifecycleError(rid, "open", self._open[rid].phase.value)
        if rid in self._retired:
            raise LifecycleError(rid, "open", f"retired ({self._retired[rid]})")
        self._open[rid] = _Entry(request)

    def admit(self, request_id: str, scheduled_time: float | None = None) -> bool:
        entry = self._live(request_id, "admit")
        if entry is None:
            return False
        if entry.phase is not _Phase.PARKED:
            raise LifecycleError(request_id, "admit", entry.phase.value)
        entry.phase = _Phase.ADMITTED
        entry.prompt_tokens = len(entry.request.prompt_token_ids)
        self._pend(request_id).admission = Admission(
            queued_time=entry.request.arrival_time,
            scheduled_time=time.monotonic() if scheduled_time is None else scheduled_time,
            prompt_tokens=entry.prompt_tokens,
        )
        return True

    def reject(self, request_id: str, reason: RejectReason, message: str) -> None:
        entry = self._live(request_id, "reject")
        if entry is None:
            return
        if entry.phase is not _Phase.PARKED:
            raise LifecycleError(request_id, "reject", entry.phase.value)
        self._close(request_id, Rejected(reason, message), "rejected")

    def record_cached(self, request_id: str, cached_tokens: int) -> None:
        entry = self._live(request_id, "record_cached")
        if entry is None:
            return
        if entry.phase is not _Phase.ADMITTED:
            raise LifecycleError(request_id, "record_cached", entry.phase.value)
        self._pend(request_id).cached_tokens = cached_tokens

    def commit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> None:
        # Once per row per step: the open, admitted entry is checked first, the rest only if not.
        entry = self._open.get(request_id)
        if entry is None or entry.phase is not _Phase.ADMITTED:
            entry = self._live(request_id, "commit")
            if entry is None:
                return
            raise LifecycleError(request_id, "commit", entry.phase.value)
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"request {request_id!r}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
        # The step's first fact about a decoding request is usually its token: the update is made
        # with it (positional: a dataclass's keyword call costs 2.5× that).
        tokens = tuple(token_ids)
        update = self._pending.get(request_id)
        if update is None:
            self._pending[request_id] = RequestUpdate(
                request_id, None, tokens, None if logprobs is None else tuple(logprobs)
            )
        else:
            update.new_token_ids += tokens
            if logprobs is not None:
                update.logprobs = (update.logprobs or ()) + tuple(logprobs)
        entry.completion_tokens += len(tokens)

    def finish(self, request_id: str, reason: FinishReason) -> None:
        entry = self._live(request_id, "finish")
        if entry is None:
            return
        if entry.phase is not _Phase.ADMITTED:
            raise LifecycleError(request_id, "finish", entry.phase.value)
        self._close(request_id, Finished(reason, entry.prompt_tokens, entry.completion_tokens), "finished")

    def fail(self, request_id: str, message: str) -> None:
        if self._live(request_id, "fail") is None:
            return
        self._close(request_id, Failed(message), "failed")

    def abort(self, request_id: str) -> bool:
        """Retire silently. Returns whether the request was open. Aborting an id the ledger has
        never seen, or one already retired, is not an error: a client may race its own finish."""
        if request_id not in self._open:
            return False
        del self._open[request_id]
        self._pending.pop(request_id, None)
        self._remember(request_id, "aborted")
        return True

    def drain(self) -> StepOutputs:
        """Everything recorded since the last drain, one update per request."""
        updates = tuple(self._pending.values())
        self._pending = {}
        return StepOutputs(updates)

    # -- internals -----------------------------------------------------------------------------

    def _entry(self, request_id: str, transition: str) -> _Entry:
        entry = self._open.get(request_id)
        if entry is None:
            state = self._retired.get(request_id, "unknown")
            raise LifecycleError(request_id, transition, state)
        return entry

    def _live(self, request_id: str, transition: str) -> _Entry | None:
        """The open entry, or None for an aborted request (its late updates are dropped). Open and
        retired ids are disjoint, so the open entry, the common case, is looked up first."""
        entry = self._open.get(request_id)
        if entry is not None:
            return entry
        if self._retired.get(request_id) == "aborted":
            return None
        return self._entry(request_id, transition)

    def _pend(self, request_id: str) -> RequestUpdate:
        update = self._pending.get(request_id)
        if update is None:
            update = self._pending[request_id] = RequestUpdate(request_id)
        return update

    def _close(self, request_id: str, terminal: Terminal, how: str) -> None:
        self._pend(request_id).terminal = terminal
        del self._open[request_id]
        self._remember(request_id, how)

    def _remember(self, request_id: str, how: str) -> None:
        self._retired[request_id] = how
        self._retired.move_to_end(request_id)
        while len(self._retired) > _RETIRED_MEMORY:
            self._retired.popitem(last=False)
