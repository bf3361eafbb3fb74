"""Stop strings, matched on the decoded output text.

The text is cut before the earliest stop string. While streaming, the last `longest - 1`
characters are held back: they may be the start of a stop string the next token completes, and
text already sent cannot be taken back.
"""

from __future__ import annotations


class OutputText:
    """The output text of one request, what of it has been emitted, and where a stop string cut it."""

    __slots__ = ("_emitted", "_hold", "_stops", "stop_index", "text")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self._emitted = 0
        # Index in `text` where the first stop string begins, once one has appeared.
        self.stop_index: int | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_index is not None

    def append(self, delta: str) -> bool:
        """Add decoded text; True when this completes a stop string."""
        if not delta or self.stop_index is not None:
            return False
        # A stop string may straddle the old end of the text, so search from `hold` back.
        search_from = max(0, len(self.text) - self._hold)
        self.text += delta
        if not self._stops:
            return False
        found = [i for i in (self.text.find(s, search_from) for s in self._stops) if i >= 0]
        if not found:
            return False
        self.stop_index = min(found)
        return True

    def take(self, final: bool) -> str:
        """The next piece of text that is safe to send."""
        if self.stop_index is not None:
            end = self.stop_index
        elif final:
            end = len(self.text)
        else:
            end = max(self._emitted, len(self.text) - self._hold)
        piece = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return piece

    @property
    def final_text(self) -> str:
        return self.text if self.stop_index is None else self.text[: self.stop_index]
