"""How engine/ and models/ report what a user waits for: one task at a time, and one-line notes.

The runtime never draws anything: it calls a `ProgressSink` (weights loaded, kernels built, graphs
captured), and infer_cli/ renders it (rich bars on the terminal). `SILENT` drops everything.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class ProgressSink(Protocol):
    def start(self, label: str, total: float) -> None:
        """A task begins: `total` units (tensors, bytes, buckets) to go."""
        ...

    def advance(self, detail: str = "", amount: float = 1) -> None:
        """`amount` more units of the current task are done; `detail` says what now runs."""
        ...

    def finish(self) -> None:
        """The current task is over (done, or given up on an error)."""
        ...

    def note(self, message: str) -> None:
        """A one-line result the user should read (start-up's memory budget, say)."""
        ...


class _Silent:
    def start(self, label: str, total: float) -> None:
        pass

    def advance(self, detail: str = "", amount: float = 1) -> None:
        pass

    def finish(self) -> None:
        pass

    def note(self, message: str) -> None:
        pass


SILENT: ProgressSink = _Silent()


@contextmanager
def task(sink: ProgressSink, label: str, total: float) -> Iterator[ProgressSink]:
    """`sink.start(label, total)`, then `finish()` however the block ends."""
    sink.start(label, total)
    try:
        yield sink
    finally:
        sink.finish()
