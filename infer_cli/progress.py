"""Rendering the runtime's progress (engine.progress.ProgressSink) on a rich console.

One transient bar per task while it runs; notes are printed as lines and stay.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)


class RichProgress:
    """A `ProgressSink` drawing on `console`. `in_bytes`: task units are bytes (shown as sizes and
    a rate); `keep`: finished bars stay on screen instead of vanishing."""

    def __init__(self, console: Console, *, in_bytes: bool = False, keep: bool = False) -> None:
        self._console = console
        self._in_bytes = in_bytes
        self._keep = keep
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def _columns(self) -> list[ProgressColumn]:
        counts: list[ProgressColumn] = (
            [DownloadColumn(), TransferSpeedColumn()] if self._in_bytes else [MofNCompleteColumn()]
        )
        return [
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            *counts,
            TimeElapsedColumn(),
            TextColumn("{task.fields[detail]}", style="dim"),
        ]

    def start(self, label: str, total: float) -> None:
        self.finish()
        self._bar = Progress(*self._columns(), console=self._console, transient=not self._keep)
        self._bar.start()
        self._task = self._bar.add_task(label, total=total, detail="")

    def advance(self, detail: str = "", amount: float = 1) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=amount, detail=detail)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        self._bar, self._task = None, None

    def note(self, message: str) -> None:
        self._console.print(message, markup=False, highlight=False)
