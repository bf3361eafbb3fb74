"""Client disconnects, noticed the moment they happen, and the SSE response that uses them.

Once a request's body has been read, the ASGI `receive` channel has nothing left to say except
`http.disconnect`; a task parked on it wakes exactly when the client goes away, so the request is
aborted in the engine at once, not at its next token or when a write happens to fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def on_disconnect(receive: Receive, callback: Callable[[], None]) -> AsyncIterator[None]:
    """Run `callback` if the client disconnects while the body of this block runs."""

    async def watch() -> None:
        await _wait_for_disconnect(receive)
        callback()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


class EventStreamResponse(Response):
    """`text/event-stream` from an async iterator of ready-made SSE events.

    `on_disconnect` runs when the client goes away mid-stream; the events iterator is then expected
    to end promptly (its source is aborted), and is closed either way.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_disconnect: Callable[[], None],
        headers: dict[str, str] | None = None,
        background: BackgroundTask | None = None,
    ) -> None:
        super().__init__(
            content=None,
            status_code=200,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})},
            media_type=self.media_type,
            background=background,
        )
        # Content-Length from the base class would be wrong for a stream.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._events = events
        self._on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async with on_disconnect(receive, self._on_disconnect):
                async for event in self._events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            # A server that reports a dead socket by raising rather than by `http.disconnect`.
            self._on_disconnect()
        finally:
            closer: Any = getattr(self._events, "aclose", None)
            if closer is not None:
                await closer()
        if self.background is not None:
            await self.background()
