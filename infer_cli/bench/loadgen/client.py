"""One streaming request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx


class Endpoint(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Times are seconds; `chunk_gaps` are the gaps between successive
    chunks that carried text (inter-token latency as a client sees it)."""

    prompt_chars: int
    started: float = 0.0
    success: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(
    endpoint: Endpoint, model: str, prompt: str, max_tokens: int, *, stream: bool = True
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if endpoint is Endpoint.COMPLETIONS:
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _chunk_text(endpoint: Endpoint, event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint is Endpoint.COMPLETIONS:
        return str(choice.get("text") or "")
    return str((choice.get("delta") or {}).get("content") or "")


async def stream_request(
    client: httpx.AsyncClient, endpoint: Endpoint, body: dict[str, Any], record: RequestRecord
) -> RequestRecord:
    """Send one streaming request and fill `record`; never raises for a failed request."""
    record.started = time.perf_counter()
    last: float | None = None
    text_chunks = 0
    try:
        async with client.stream("POST", endpoint.path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                record.error = f"HTTP {response.status_code}: {detail}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    record.error = f"stream error: {event['error'].get('message', event['error'])}"
                    return record
                now = time.perf_counter()
                if _chunk_text(endpoint, event):
                    text_chunks += 1
                    if last is None:
                        record.ttft = now - record.started
                    else:
                        record.chunk_gaps.append(now - last)
                    last = now
                usage = event.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.output_tokens = int(usage.get("completion_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e = time.perf_counter() - record.started
    if record.output_tokens == 0:
        # A server that sends no usage: one token per text chunk is the best guess.
        record.output_tokens = text_chunks
    record.success = record.ttft is not None
    if not record.success:
        record.error = "the stream carried no text"
    return record


async def prompt_tokens_of(client: httpx.AsyncClient, endpoint: Endpoint, model: str, prompt: str) -> int:
    """How many prompt tokens the server counts for `prompt` (one non-streaming 1-token request)."""
    response = await client.post(endpoint.path, json=request_body(endpoint, model, prompt, 1, stream=False))
    if response.status_code != 200:
        raise ProbeError(f"{endpoint.path} answered HTTP {response.status_code}: {response.text[:300]}")
    usage = response.json().get("usage") or {}
    tokens = usage.get("prompt_tokens")
    if not isinstance(tokens, int):
        raise ProbeError(f"{endpoint.path} reported no usage.prompt_tokens")
    return tokens


class ProbeError(RuntimeError):
    """The server cannot be benchmarked as asked (unreachable, refusing, or missing usage)."""
