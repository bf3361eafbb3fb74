"""Request bodies of /v1/completions and /v1/chat/completions: parsed, type-checked, normalised.

Validation is strict and by name. A wrong JSON type is refused, never coerced ("5" is not an
integer, `true` is not 1). A field this server does not implement is refused by name: it would
change what the client gets, so silently ignoring it is a wrong answer. The one allowance is a
known OpenAI field sent with its documented no-op value (`n: 1`, `presence_penalty: 0`,
`echo: false`, ...) or `null`, which asks for nothing this server does not do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from infer_cli.http.errors import APIError, bad_request
from models.registry import ChatMessage

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
_INT64 = 2**63

# Known OpenAI / vLLM fields this server does not implement, with the value that asks for nothing
# (accepted), or _NO_NEUTRAL where any non-null value is refused.
_NO_NEUTRAL = object()
_UNSUPPORTED_COMMON: dict[str, object] = {
    "n": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "stop_token_ids": [],
    "min_tokens": 0,
    "guided_json": _NO_NEUTRAL,
    "guided_regex": _NO_NEUTRAL,
    "guided_choice": _NO_NEUTRAL,
    "structured_outputs": _NO_NEUTRAL,
}
_UNSUPPORTED_COMPLETIONS: dict[str, object] = {
    **_UNSUPPORTED_COMMON,
    "best_of": 1,
    "echo": False,
    "suffix": "",
}
_UNSUPPORTED_CHAT: dict[str, object] = {
    **_UNSUPPORTED_COMMON,
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "parallel_tool_calls": _NO_NEUTRAL,
    "audio": _NO_NEUTRAL,
    "modalities": ["text"],
    "prediction": _NO_NEUTRAL,
    "reasoning_effort": _NO_NEUTRAL,
    "web_search_options": _NO_NEUTRAL,
    "store": False,
    "metadata": _NO_NEUTRAL,
    "service_tier": _NO_NEUTRAL,
}


@dataclass(frozen=True, slots=True)
class CommonParams:
    """What both endpoints share, before the prompt is tokenised."""

    model: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    user: str | None


@dataclass(frozen=True, slots=True)
class CompletionSpec:
    # Text to tokenise, or token ids to use as they are.
    prompt: str | tuple[int, ...]
    # None: no logprobs; k: the chosen token's log-prob and the top k alternatives.
    logprobs: int | None
    common: CommonParams


@dataclass(frozen=True, slots=True)
class ChatSpec:
    messages: tuple[ChatMessage, ...]
    logprobs: bool
    top_logprobs: int
    common: CommonParams


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _wrong_type(param: str, expected: str, value: object) -> APIError:
    return bad_request(
        f"'{param}' must be {expected}, got {json_type(value)}", param=param, code="invalid_type"
    )


class _FieldReader:
    """Takes typed fields out of one JSON object; whatever is left at the end is unknown."""

    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self._body = dict(body)
        self._prefix = prefix

    def _name(self, name: str) -> str:
        return f"{self._prefix}{name}"

    def raw(self, name: str) -> object:
        return self._body.pop(name, None)

    def required(self, name: str) -> object:
        if name not in self._body or self._body[name] is None:
            raise bad_request(
                f"'{self._name(name)}' is required", param=self._name(name), code="missing_required_parameter"
            )
        return self._body.pop(name)

    def integer(self, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
        value = self._body.pop(name, None)
        if value is None:
            return None
        param = self._name(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong_type(param, "an integer", value)
        if minimum is not None and value < minimum:
            raise bad_request(f"'{param}' must be at least {minimum}, got {value}", param=param)
        if maximum is not None and value > maximum:
            raise bad_request(f"'{param}' must be at most {maximum}, got {value}", param=param)
        return value

    def number(self, name: str) -> float | None:
        value = self._body.pop(name, None)
        if value is None:
            return None
        param = self._name(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type(param, "a number", value)
        number = float(value)
        if not math.isfinite(number):
            raise bad_request(f"'{param}' must be a finite number, got {value}", param=param)
        return number

    def boolean(self, name: str) -> bool | None:
        value = self._body.pop(name, None)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise _wrong_type(self._name(name), "a boolean", value)
        return value

    def string(self, name: str) -> str | None:
        value = self._body.pop(name, None)
        if value is None:
            return None
        if not isinstance(value, str):
            raise _wrong_type(self._name(name), "a string", value)
        return value

    def refuse_unsupported(self, table: dict[str, object]) -> None:
        for name, neutral in table.items():
            if name not in self._body:
                continue
            value = self._body.pop(name)
            if value is None or (neutral is not _NO_NEUTRAL and _same_json(value, neutral)):
                continue
            raise bad_request(
                f"'{self._name(name)}' is not supported by this server",
                param=self._name(name),
                code="unsupported_parameter",
            )

    def refuse_leftovers(self) -> None:
        if self._body:
            name = self._name(sorted(self._body)[0])
            raise bad_request(f"unrecognized request field '{name}'", param=name, code="unknown_parameter")


def _same_json(value: object, neutral: object) -> bool:
    # `true == 1` in Python; in JSON a boolean is not a number.
    if isinstance(value, bool) != isinstance(neutral, bool):
        return False
    if isinstance(neutral, int | float) and not isinstance(neutral, bool):
        return isinstance(value, int | float) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _require_object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(
            f"the request body must be a JSON object, got {json_type(body)}", code="invalid_type"
        )
    return body


def _read_stop(fields: _FieldReader) -> tuple[str, ...]:
    value = fields.raw("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        stops = [value]
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        stops = value
    else:
        raise _wrong_type("stop", "a string or an array of strings", value)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    if any(s == "" for s in stops):
        raise bad_request("'stop' strings must not be empty", param="stop")
    return tuple(dict.fromkeys(stops))


def _read_common(fields: _FieldReader, max_tokens: int | None) -> CommonParams:
    model = fields.string("model")
    temperature = fields.number("temperature")
    if temperature is not None and temperature < 0:
        raise bad_request(f"'temperature' must be >= 0, got {temperature}", param="temperature")
    top_p = fields.number("top_p")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    # vLLM spells "no top-k" as -1; the engine spells it 0.
    top_k = fields.integer("top_k", minimum=-1)
    min_p = fields.number("min_p")
    if min_p is not None and not (0.0 <= min_p <= 1.0):
        raise bad_request(f"'min_p' must be in [0, 1], got {min_p}", param="min_p")
    seed = fields.integer("seed", minimum=-_INT64, maximum=_INT64 - 1)
    stop = _read_stop(fields)
    ignore_eos = fields.boolean("ignore_eos")
    stream = bool(fields.boolean("stream"))
    options = fields.raw("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        if not isinstance(options, dict):
            raise _wrong_type("stream_options", "an object", options)
        option_fields = _FieldReader(options, prefix="stream_options.")
        include_usage = bool(option_fields.boolean("include_usage"))
        option_fields.refuse_unsupported(
            {"continuous_usage_stats": False, "include_obfuscation": _NO_NEUTRAL}
        )
        option_fields.refuse_leftovers()
    user = fields.string("user")
    return CommonParams(
        model=model,
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None or top_k == -1 else top_k,
        min_p=0.0 if min_p is None else min_p,
        seed=seed,
        stop=stop,
        ignore_eos=bool(ignore_eos),
        stream=stream,
        include_usage=include_usage,
        user=user,
    )


def _read_prompt(value: object) -> str | tuple[int, ...]:
    # One prompt per request: a string, token ids, or a batch holding exactly one of those.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad_request("'prompt' must not be empty", param="prompt")
        return value
    if isinstance(value, list):
        if not value:
            raise bad_request("'prompt' must not be empty", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if any(t < 0 for t in value):
                raise bad_request("'prompt' token ids must be >= 0", param="prompt")
            return tuple(value)
        if all(isinstance(p, str | list) for p in value):
            raise bad_request(
                f"'prompt' holds {len(value)} prompts; batched prompts are not supported, send one per request",
                param="prompt",
                code="unsupported_parameter",
            )
    raise _wrong_type("prompt", "a string or an array of token ids", value)


def _max_tokens(fields: _FieldReader, name: str) -> int | None:
    return fields.integer(name, minimum=1)


def parse_completion(body: object) -> CompletionSpec:
    fields = _FieldReader(_require_object(body))
    fields.refuse_unsupported(_UNSUPPORTED_COMPLETIONS)
    prompt = _read_prompt(fields.required("prompt"))
    max_tokens = _max_tokens(fields, "max_tokens")
    logprobs = fields.integer("logprobs", minimum=0, maximum=MAX_LOGPROBS)
    common = _read_common(fields, max_tokens)
    fields.refuse_leftovers()
    return CompletionSpec(prompt=prompt, logprobs=logprobs, common=common)


def _read_message(index: int, value: object) -> ChatMessage:
    prefix = f"messages[{index}]."
    if not isinstance(value, dict):
        raise _wrong_type(f"messages[{index}]", "an object", value)
    fields = _FieldReader(value, prefix=prefix)
    role = fields.required("role")
    if not isinstance(role, str):
        raise _wrong_type(f"{prefix}role", "a string", role)
    if role not in CHAT_ROLES:
        raise bad_request(
            f"'{prefix}role' must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}",
            param=f"{prefix}role",
        )
    content = _read_content(prefix, fields.required("content"))
    fields.refuse_unsupported({"name": _NO_NEUTRAL, "tool_calls": [], "tool_call_id": _NO_NEUTRAL})
    fields.refuse_leftovers()
    return ChatMessage(role=role, content=content)


def _read_content(prefix: str, value: object) -> str:
    param = f"{prefix}content"
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _wrong_type(param, "a string or an array of text parts", value)
    texts: list[str] = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise _wrong_type(f"{param}[{i}]", "an object", part)
        part_type = part.get("type")
        if part_type != "text":
            raise bad_request(
                f"'{param}[{i}].type' {part_type!r} is not supported; only text parts are",
                param=f"{param}[{i}].type",
                code="unsupported_parameter",
            )
        part_fields = _FieldReader(part, prefix=f"{param}[{i}].")
        part_fields.raw("type")
        text = part_fields.required("text")
        if not isinstance(text, str):
            raise _wrong_type(f"{param}[{i}].text", "a string", text)
        part_fields.refuse_leftovers()
        texts.append(text)
    return "".join(texts)


def parse_chat(body: object) -> ChatSpec:
    fields = _FieldReader(_require_object(body))
    fields.refuse_unsupported(_UNSUPPORTED_CHAT)
    raw_messages = fields.required("messages")
    if not isinstance(raw_messages, list):
        raise _wrong_type("messages", "an array", raw_messages)
    if not raw_messages:
        raise bad_request("'messages' must hold at least one message", param="messages")
    messages = tuple(_read_message(i, m) for i, m in enumerate(raw_messages))
    max_completion_tokens = _max_tokens(fields, "max_completion_tokens")
    max_tokens = _max_tokens(fields, "max_tokens")
    if max_completion_tokens is not None and max_tokens is not None and max_completion_tokens != max_tokens:
        raise bad_request(
            f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({max_completion_tokens}) disagree; "
            "send one of them",
            param="max_tokens",
        )
    logprobs = bool(fields.boolean("logprobs"))
    top_logprobs = fields.integer("top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top_logprobs is not None and top_logprobs > 0 and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    common = _read_common(fields, max_completion_tokens if max_completion_tokens is not None else max_tokens)
    fields.refuse_leftovers()
    return ChatSpec(messages=messages, logprobs=logprobs, top_logprobs=top_logprobs or 0, common=common)
