"""Answering one generation request: a whole JSON response, or an SSE stream.

Both watch for the client going away and abort the request in the engine the moment it does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from engine.contract import TokenLogprob
from infer_cli.http.disconnect import EventStreamResponse, on_disconnect
from infer_cli.http.errors import ErrorInfo
from infer_cli.http.generation import Generation
from infer_cli.http.render import DONE_EVENT, ChatRenderer, CompletionRenderer, error_event

Renderer = CompletionRenderer | ChatRenderer


def error_response(info: ErrorInfo, headers: dict[str, str] | None = None) -> Response:
    return Response(
        info.json_bytes(), status_code=info.status, headers=headers, media_type="application/json"
    )


def _id_header(gen: Generation) -> dict[str, str]:
    # Lets a client (and the logs) name the engine request behind any answer, errors included.
    return {"x-request-id": gen.request_id}


def _client_gone() -> Response:
    # Nobody is listening any more; this answer is never delivered.
    return error_response(ErrorInfo(400, "the client disconnected", code="client_disconnected"))


async def respond_full(gen: Generation, renderer: Renderer, http_request: HTTPRequest) -> Response:
    logprobs: list[TokenLogprob] = []
    async with on_disconnect(http_request.receive, gen.abort):
        while (delta := await gen.next_delta()) is not None:
            logprobs.extend(delta.logprobs)
    if gen.error is not None:
        return error_response(gen.error, _id_header(gen))
    if gen.aborted:
        return _client_gone()
    return JSONResponse(renderer.response(gen, logprobs), headers=_id_header(gen))


async def respond_streaming(
    gen: Generation, renderer: Renderer, include_usage: bool, http_request: HTTPRequest
) -> Response:
    # Wait for admission before answering 200: a request the engine rejects gets a real 4xx.
    async with on_disconnect(http_request.receive, gen.abort):
        await gen.wait_admitted()
    if gen.error is not None and gen.error.status < 500:
        return error_response(gen.error, _id_header(gen))
    if gen.aborted:
        return _client_gone()
    # A failure (500) is reported inside the stream: an error event, then [DONE].
    return EventStreamResponse(
        _events(gen, renderer, include_usage), on_disconnect=gen.abort, headers=_id_header(gen)
    )


async def _events(gen: Generation, renderer: Renderer, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        opening = renderer.opening_chunk()
        if opening is not None and gen.error is None:
            yield opening
        while (delta := await gen.next_delta()) is not None:
            yield renderer.chunk(delta)
        if gen.aborted:
            return
        if gen.error is not None:
            yield error_event(gen.error)
        elif include_usage:
            yield renderer.usage_chunk(gen)
        yield DONE_EVENT
    finally:
        # However the stream stops (disconnect, cancellation), the engine must let go of the request.
        gen.abort()
