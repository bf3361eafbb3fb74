"""OpenAI response bodies: whole responses and SSE chunks, for completions and chat.

Chunks sit on the hot path (one per request per step under load), so they are serialised with
compact separators and the per-request constant fields are built once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from engine.contract import TokenLogprob
from infer_cli.http.errors import ErrorInfo
from infer_cli.http.generation import Delta, Generation
from models.registry import Tokenizer

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def error_event(error: ErrorInfo) -> bytes:
    return b"data: " + error.json_bytes() + b"\n\n"


def usage(gen: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


class _TokenText:
    """Token id -> the text shown for it in log-prob listings, cached per request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


class CompletionRenderer:
    """/v1/completions: `text_completion` objects, legacy log-prob layout."""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, logprobs: int | None) -> None:
        self._id = request_id
        self._model = model
        self._created = int(time.time())
        self._logprobs = logprobs
        self._token_text = _TokenText(tokenizer)
        # Character offset of the next listed token in the completion text (for `text_offset`).
        self._offset = 0

    def _logprobs_block(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self._logprobs is None:
            return None
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top_logprobs: list[dict[str, float]] = []
        offsets: list[int] = []
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            top = {self._token_text(t): v for t, v in lp.top[: self._logprobs]}
            # Like vLLM: the chosen token is always listed, also when it is not among the top k.
            top.setdefault(text, lp.logprob)
            top_logprobs.append(top)
            offsets.append(self._offset)
            self._offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _choice(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None
    ) -> dict[str, Any]:
        return {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs_block(logprobs),
            "finish_reason": finish_reason,
        }

    def response(self, gen: Generation, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [self._choice(gen.text, logprobs, gen.finish_reason)],
            "usage": usage(gen),
        }

    def opening_chunk(self) -> bytes | None:
        return None

    def chunk(self, delta: Delta) -> bytes:
        return sse_event(
            {
                "id": self._id,
                "object": "text_completion",
                "created": self._created,
                "model": self._model,
                "choices": [self._choice(delta.text, delta.logprobs, delta.finish_reason)],
            }
        )

    def usage_chunk(self, gen: Generation) -> bytes:
        return sse_event(
            {
                "id": self._id,
                "object": "text_completion",
                "created": self._created,
                "model": self._model,
                "choices": [],
                "usage": usage(gen),
            }
        )


class ChatRenderer:
    """/v1/chat/completions: `chat.completion` objects and `chat.completion.chunk` deltas."""

    def __init__(
        self, request_id: str, model: str, tokenizer: Tokenizer, logprobs: bool, top_logprobs: int
    ) -> None:
        self._id = request_id
        self._model = model
        self._created = int(time.time())
        self._logprobs = logprobs
        self._top = top_logprobs
        self._token_text = _TokenText(tokenizer)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs_block(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        content = []
        for lp in logprobs:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in lp.top[: self._top]]
            content.append(entry)
        return {"content": content}

    def response(self, gen: Generation, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion",
            "created": self._created,
            "model": self._model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": gen.text},
                    "logprobs": self._logprobs_block(logprobs),
                    "finish_reason": gen.finish_reason,
                }
            ],
            "usage": usage(gen),
        }

    def _chunk(self, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None) -> bytes:
        return sse_event(
            {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            }
        )

    def opening_chunk(self) -> bytes | None:
        return self._chunk({"role": "assistant", "content": ""}, None, None)

    def chunk(self, delta: Delta) -> bytes:
        body = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return self._chunk(body, self._logprobs_block(delta.logprobs), delta.finish_reason)

    def usage_chunk(self, gen: Generation) -> bytes:
        return sse_event(
            {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
                "choices": [],
                "usage": usage(gen),
            }
        )
