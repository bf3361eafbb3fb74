"""Driver: one thread per scheduler; every scheduler method runs on it.

Loop: drain the inbox (submits, aborts, shutdown), `step()` while there is work, publish `load()`,
and hand each non-empty `StepOutputs` to the asyncio side with `call_soon_threadsafe`. Idle, the
thread blocks on the inbox. An exception inside a step fails that step's batch through
`Scheduler.fail_step` and the loop keeps serving; an exception the scheduler cannot recover from,
or an `EngineFatalError` from the step (after its batch is failed), is fatal: the driver reports it,
marks itself unhealthy and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from engine.contract import EngineFatalError, Load, Request, Scheduler, StepOutputs, one_line

log = logging.getLogger("infer.driver")


@dataclass(frozen=True, slots=True)
class _Submit:
    request: Request


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Shutdown:
    pass


_Message = _Submit | _Abort | _Shutdown


class Driver:
    def __init__(
        self,
        scheduler: Scheduler,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[StepOutputs], None],
        on_fatal: Callable[[str], None] | None = None,
        name: str = "infer-driver",
    ) -> None:
        self._scheduler = scheduler
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_fatal = on_fatal
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._load = scheduler.load()
        self.fatal_error: str | None = None
        self.steps = 0
        self.failed_steps = 0

    # -- called from any thread ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        self._inbox.put(_Submit(request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(_Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.fatal_error is None and self._thread.is_alive()

    @property
    def load(self) -> Load:
        """The load published after the latest step or inbox drain (a plain reference read)."""
        return self._load

    # -- the driver thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                block = not self._scheduler.has_work()
                if not self._drain_inbox(block=block):
                    return
                if self._scheduler.has_work():
                    self._step()
                self._load = self._scheduler.load()
        except BaseException as exc:
            # The traceback stays in the server's log; what clients and /health see is one line.
            log.error("driver stopped:\n%s", traceback.format_exc())
            self._die(f"driver stopped: {one_line(exc)}")

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued message; block for the first one when idle. False on shutdown."""
        try:
            message: _Message | None = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while message is not None:
            if isinstance(message, _Shutdown):
                return False
            if isinstance(message, _Submit):
                self._scheduler.submit(message.request)
            else:
                self._scheduler.abort(message.request_id)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                message = None
        self._load = self._scheduler.load()
        return True

    def _step(self) -> None:
        try:
            outputs = self._scheduler.step()
        except Exception as exc:
            self.failed_steps += 1
            log.exception("step failed; failing its batch")
            outputs = self._scheduler.fail_step(f"step failed: {one_line(exc)}")
            if isinstance(exc, EngineFatalError):
                self._load = self._scheduler.load()
                if outputs:
                    self._publish(outputs)
                raise
        self.steps += 1
        # Load first: whoever sees a step's terminals must also see the load that follows them.
        self._load = self._scheduler.load()
        if outputs:
            self._publish(outputs)

    def _publish(self, outputs: StepOutputs) -> None:
        # A closed event loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._on_outputs, outputs)

    def _die(self, message: str) -> None:
        self.fatal_error = message
        log.error(message)
        if self._on_fatal is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._on_fatal, message)
