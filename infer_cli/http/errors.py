"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure a client can cause is raised as an `APIError` carrying the offending parameter; the
app turns it (and anything Starlette raises itself, such as an unknown route) into this shape, so a
client never sees a framework's own error format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# OpenAI's `type` values, by the status family they go with.
INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        # ASCII-escaped: a message may quote what the client sent, lone surrogates included, and
        # those cannot be encoded as UTF-8.
        return json.dumps(self.body(), separators=(",", ":"), ensure_ascii=True).encode()


class APIError(Exception):
    """A request the server answers with an OpenAI error body instead of a result."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.info = ErrorInfo(status=status, message=message, type=type, param=param, code=code)


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unknown_route(status: int, path: str, method: str) -> ErrorInfo:
    if status == 405:
        return ErrorInfo(405, f"method {method} is not allowed on {path}", code="method_not_allowed")
    return ErrorInfo(status, f"no route {method} {path}", type=NOT_FOUND, code="not_found")
