"""AsyncEngine: the asyncio side of the Driver.

The driver thread publishes each step's `StepOutputs` onto the event loop; this module routes every
`RequestUpdate` to the one `RequestStream` waiting for it. A stream ends after its terminal, when
its request is aborted (silently: nothing more is routed to it, even updates already in flight), or
when the driver dies, in which case every open stream ends with a `Failed` terminal so no client is
left waiting on a request the engine will never finish.

Everything here runs on the event loop's thread except the driver itself; the driver only touches
this object through `call_soon_threadsafe`, so the routing table needs no lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.contract import Failed, Load, Request, RequestUpdate, Scheduler, StepOutputs
from engine.driver import Driver

StepObserver = Callable[[float], None]


class EngineDeadError(RuntimeError):
    """The driver has stopped; no request can be served any more. Carries the driver's reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"engine is not running: {reason}")
        self.reason = reason


class DuplicateRequestError(ValueError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already open")
        self.request_id = request_id


class RequestStream:
    """The updates of one request, in the order the driver published them.

    Iterating yields lists: every update that arrived since the consumer last looked, so a consumer
    that falls behind catches up in one wake-up instead of one per step. Iteration stops after the
    update carrying the terminal, or at once when the request is aborted.
    """

    __slots__ = ("_aborted", "_ended", "_pending", "_waiter", "request_id", "updates_received")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: list[RequestUpdate] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._aborted = False
        self.updates_received = 0

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def ended(self) -> bool:
        """True once nothing more will be routed to this stream."""
        return self._ended

    # -- fed by the engine (event-loop thread) ---------------------------------------------------

    def _push(self, update: RequestUpdate) -> None:
        self.updates_received += 1
        self._pending.append(update)
        if update.terminal is not None:
            self._ended = True
        self._wake()

    def _abort(self) -> None:
        self._ended = True
        self._aborted = True
        # Anything already queued but not consumed was produced before the abort; dropping it keeps
        # the promise that an aborted request sees nothing further.
        self._pending.clear()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- consumed by a request handler -----------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[RequestUpdate]:
        while not self._pending:
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch = self._pending
        self._pending = []
        return batch


@dataclass(frozen=True, slots=True)
class EngineCounters:
    submitted: int
    aborted: int
    # Updates that arrived for a request no stream waits for any more (aborted before the update
    # was produced, or routed after its terminal). Dropped by design; counted so tests can see them.
    dropped_updates: int
    open_streams: int


class _TimedScheduler:
    """Passes every call through, timing `step` (on the driver thread) for `on_step`."""

    def __init__(self, inner: Scheduler, on_step: StepObserver) -> None:
        self._inner = inner
        self._on_step = on_step

    def submit(self, request: Request) -> None:
        self._inner.submit(request)

    def abort(self, request_id: str) -> None:
        self._inner.abort(request_id)

    def step(self) -> StepOutputs:
        start = time.perf_counter()
        outputs = self._inner.step()
        self._on_step(time.perf_counter() - start)
        return outputs

    def fail_step(self, message: str) -> StepOutputs:
        return self._inner.fail_step(message)

    def load(self) -> Load:
        return self._inner.load()

    def has_work(self) -> bool:
        return self._inner.has_work()


class AsyncEngine:
    """Owns one Driver and routes its outputs to per-request streams. `on_step`, when given, is
    called on the driver thread with the duration of every successful step."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        name: str = "infer-driver",
        on_fatal: Callable[[str], None] | None = None,
        on_step: StepObserver | None = None,
    ) -> None:
        self._scheduler: Scheduler = scheduler if on_step is None else _TimedScheduler(scheduler, on_step)
        self._name = name
        self._external_on_fatal = on_fatal
        self._driver: Driver | None = None
        self._streams: dict[str, RequestStream] = {}
        self._fatal: str | None = None
        self._submitted = 0
        self._aborted = 0
        self._dropped = 0
        self.started_at: float | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the driver thread; must be called from the event loop that will consume outputs."""
        if self._driver is not None:
            raise RuntimeError("AsyncEngine.start called twice")
        loop = asyncio.get_running_loop()
        self._driver = Driver(
            self._scheduler, loop, self._on_outputs, on_fatal=self._on_fatal, name=self._name
        )
        self._driver.start()
        self.started_at = time.monotonic()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the driver and end every open stream with a `Failed` terminal."""
        driver = self._driver
        if driver is not None:
            await asyncio.to_thread(driver.shutdown, timeout)
        self._fail_open_streams("server is shutting down")

    # -- state ----------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._fatal is None and self._driver is not None and self._driver.healthy

    @property
    def fatal_error(self) -> str | None:
        if self._fatal is not None:
            return self._fatal
        if self._driver is not None and self._driver.fatal_error is not None:
            return self._driver.fatal_error
        return None

    @property
    def load(self) -> Load:
        """The scheduler's load as the driver last published it."""
        if self._driver is None:
            return self._scheduler.load()
        return self._driver.load

    @property
    def counters(self) -> EngineCounters:
        return EngineCounters(self._submitted, self._aborted, self._dropped, len(self._streams))

    def is_open(self, request_id: str) -> bool:
        return request_id in self._streams

    # -- requests -------------------------------------------------------------------------------

    def generate(self, request: Request) -> RequestStream:
        """Submit a request and return the stream its updates arrive on."""
        driver = self._driver
        if driver is None:
            raise EngineDeadError("engine not started")
        if not self.healthy:
            raise EngineDeadError(self.fatal_error or "driver thread is not running")
        if request.request_id in self._streams:
            raise DuplicateRequestError(request.request_id)
        stream = RequestStream(request.request_id)
        self._streams[request.request_id] = stream
        self._submitted += 1
        driver.submit(request)
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort an open request: its stream ends now and the scheduler frees its pages on the
        driver's next inbox drain. Returns False when the request had already ended."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        stream._abort()
        self._aborted += 1
        if self._driver is not None:
            self._driver.abort(request_id)
        return True

    # -- driver callbacks (event-loop thread, via call_soon_threadsafe) ---------------------------

    def _on_outputs(self, outputs: StepOutputs) -> None:
        streams = self._streams
        for update in outputs.updates:
            stream = streams.get(update.request_id)
            if stream is None:
                self._dropped += 1
                continue
            stream._push(update)
            if update.terminal is not None:
                del streams[update.request_id]

    def _on_fatal(self, message: str) -> None:
        self._fatal = message
        self._fail_open_streams(message)
        if self._external_on_fatal is not None:
            self._external_on_fatal(message)

    def _fail_open_streams(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream._push(RequestUpdate(request_id=request_id, terminal=Failed(message)))
