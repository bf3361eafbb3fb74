"""Running the app under uvicorn: in the foreground for `infer serve`, or on a background thread
(tests, in-process benchmarks) with the port the OS picked reported back.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI


class ServerStartError(RuntimeError):
    def __init__(self, host: str, port: int, why: str) -> None:
        super().__init__(f"could not serve on {host}:{port}: {why}")
        self.host = host
        self.port = port


def _config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    # One process, one event loop; the access log costs a line per request, so it is off.
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )


def bound_port(server: uvicorn.Server) -> int:
    for listener in server.servers:
        for sock in listener.sockets:
            port: int = sock.getsockname()[1]
            return port
    raise RuntimeError("uvicorn server has no listening socket")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so a taken port is a clear error rather than uvicorn
    exiting the process from inside the event loop."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise ServerStartError(host, port, exc.strerror or str(exc)) from None


async def serve(
    app: FastAPI, host: str, port: int, on_listening: Callable[[int], None], log_level: str = "warning"
) -> None:
    """Serve until interrupted; `on_listening(port)` runs once the socket accepts connections."""
    sock = bind(host, port)
    server = uvicorn.Server(_config(app, host, port, log_level))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        on_listening(bound_port(server))
    await task
    if not server.started:
        raise ServerStartError(host, port, "see the log above")


class BackgroundServer:
    """uvicorn on its own thread and event loop. Port 0 asks the OS for a free one."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self.host = host
        self._server = uvicorn.Server(_config(app, host, port, log_level))
        self._thread = threading.Thread(target=self._server.run, name="infer-http", daemon=True)
        self.port = port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise ServerStartError(self.host, self.port, "the server thread exited during startup")
            if time.monotonic() > deadline:
                raise ServerStartError(self.host, self.port, f"not listening after {timeout:.0f} s")
            time.sleep(0.01)
        self.port = bound_port(self._server)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
