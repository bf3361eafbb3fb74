"""Helpers for the `infer bench serve` tests."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from engine.contract import Load, Request, Scheduler, StepOutputs


class ConcurrencyTracker:
    """A pass-through scheduler that records the most requests ever open in it at once."""

    def __init__(self, inner: Scheduler) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._open: set[str] = set()
        self.max_open = 0

    def reset(self) -> None:
        with self._lock:
            self.max_open = len(self._open)

    def submit(self, request: Request) -> None:
        with self._lock:
            self._open.add(request.request_id)
            self.max_open = max(self.max_open, len(self._open))
        self._inner.submit(request)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._open.discard(request_id)
        self._inner.abort(request_id)

    def _closed(self, outputs: StepOutputs) -> StepOutputs:
        with self._lock:
            for update in outputs.updates:
                if update.terminal is not None:
                    self._open.discard(update.request_id)
        return outputs

    def step(self) -> StepOutputs:
        return self._closed(self._inner.step())

    def fail_step(self, message: str) -> StepOutputs:
        return self._closed(self._inner.fail_step(message))

    def load(self) -> Load:
        return self._inner.load()

    def has_work(self) -> bool:
        return self._inner.has_work()


@dataclass
class SimServer:
    url: str
    tracker: ConcurrencyTracker
