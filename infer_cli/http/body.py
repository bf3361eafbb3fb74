"""Reading a JSON request body under a size limit.

The limit is checked against Content-Length before anything is read, and again while reading, so a
chunked upload with no length cannot grow past it either.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import ClientDisconnect, Request

from infer_cli.http.errors import APIError, bad_request

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")


def _refuse_constant(name: str) -> float:
    # Python's json accepts NaN and Infinity; JSON does not.
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_bytes = int(declared)
        except ValueError:
            raise bad_request(
                f"Content-Length {declared!r} is not a number", code="invalid_request"
            ) from None
        if declared_bytes > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody will read this answer; it only keeps a half-sent upload out of the error log.
        raise bad_request(
            "the client disconnected while sending the body", code="client_disconnected"
        ) from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty; a JSON object is expected", code="invalid_json")
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body nests too deeply", code="invalid_json") from None
