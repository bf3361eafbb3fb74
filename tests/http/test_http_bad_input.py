"""Malformed requests: each gets the right 4xx and an OpenAI error body; none a 5xx, none a leak."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from http_support import LiveServer, live_server

from models.sim import SimOptions

MAX_MODEL_LEN = 256
MAX_BODY = 64 * 1024
C = "/v1/completions"
H = "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    # A dict is sent as JSON; bytes are sent as they are.
    body: dict[str, object] | bytes
    status: int
    code: str
    param: str | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def chat(**fields: object) -> dict[str, object]:
    return {"model": "sim", "messages": OK_CHAT, "max_tokens": 4, **fields}


def completion(**fields: object) -> dict[str, object]:
    return {"model": "sim", "prompt": "hi", "max_tokens": 4, **fields}


def without(body: dict[str, object], key: str) -> dict[str, object]:
    return {k: v for k, v in body.items() if k != key}


CASES = [
    # The body itself.
    Case("invalid json", C, b'{"prompt": "hi", ', 400, "invalid_json"),
    Case("invalid json chat", H, b"{messages: []}", 400, "invalid_json"),
    Case("empty body", C, b"", 400, "invalid_json"),
    Case("not utf-8", C, b'{"prompt": "\xff\xfe"}', 400, "invalid_json"),
    Case("NaN literal", C, b'{"prompt": "hi", "temperature": NaN}', 400, "invalid_json"),
    Case("array body", C, b"[1, 2]", 400, "invalid_type"),
    Case("deeply nested body", C, b"[" * 20000 + b"]" * 20000, 400, "invalid_json"),
    Case("lone surrogate in a prompt", C, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "invalid_value"),
    Case(
        "lone surrogate in a message",
        H,
        b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
        400,
        "invalid_value",
    ),
    Case(
        "lone surrogate in a field name",
        C,
        b'{"prompt": "a", "\\ud800": 1}',
        400,
        "unknown_parameter",
    ),
    Case("huge integer", C, b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400, "invalid_json"),
    Case("infinite float", C, b'{"prompt": "a", "temperature": 1e400}', 400, "invalid_value", "temperature"),
    Case("body over the size limit", C, completion(prompt="x" * (MAX_BODY + 10)), 413, "request_too_large"),
    # Required fields.
    Case("missing prompt", C, without(completion(), "prompt"), 400, "missing_required_parameter", "prompt"),
    Case("null prompt", C, completion(prompt=None), 400, "missing_required_parameter", "prompt"),
    Case("missing messages", H, without(chat(), "messages"), 400, "missing_required_parameter", "messages"),
    Case("empty messages", H, chat(messages=[]), 400, "invalid_value", "messages"),
    Case("messages not an array", H, chat(messages="hi"), 400, "invalid_type", "messages"),
    Case("message not an object", H, chat(messages=["hi"]), 400, "invalid_type", "messages[0]"),
    Case(
        "message without role",
        H,
        chat(messages=[{"content": "x"}]),
        400,
        "missing_required_parameter",
        "messages[0].role",
    ),
    Case(
        "message with unknown role",
        H,
        chat(messages=[{"role": "robot", "content": "x"}]),
        400,
        "invalid_value",
        "messages[0].role",
    ),
    Case(
        "message content a number",
        H,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "invalid_type",
        "messages[0].content",
    ),
    Case(
        "image content part",
        H,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "unsupported_parameter",
        "messages[0].content[0].type",
    ),
    Case(
        "tool message fields",
        H,
        chat(messages=[{"role": "user", "content": "x", "name": "bob"}]),
        400,
        "unsupported_parameter",
        "messages[0].name",
    ),
    Case("empty prompt", C, completion(prompt=""), 400, "invalid_value", "prompt"),
    Case("prompt a number", C, completion(prompt=12), 400, "invalid_type", "prompt"),
    Case("batched prompts", C, completion(prompt=["a", "b"]), 400, "unsupported_parameter", "prompt"),
    Case("negative token id", C, completion(prompt=[1, -2]), 400, "invalid_value", "prompt"),
    # Lengths.
    Case("max_tokens zero", C, completion(max_tokens=0), 400, "invalid_value", "max_tokens"),
    Case("max_tokens negative", H, chat(max_tokens=-5), 400, "invalid_value", "max_tokens"),
    Case("max_tokens a string", C, completion(max_tokens="10"), 400, "invalid_type", "max_tokens"),
    Case("max_tokens a float", C, completion(max_tokens=1.5), 400, "invalid_type", "max_tokens"),
    Case("max_tokens a boolean", C, completion(max_tokens=True), 400, "invalid_type", "max_tokens"),
    Case(
        "max_completion_tokens zero",
        H,
        without(chat(max_completion_tokens=0), "max_tokens"),
        400,
        "invalid_value",
        "max_completion_tokens",
    ),
    Case("max_tokens disagrees", H, chat(max_completion_tokens=9), 400, "invalid_value", "max_tokens"),
    Case(
        "prompt + max_tokens over the context",
        C,
        completion(max_tokens=MAX_MODEL_LEN),
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    Case(
        "chat prompt alone over the context",
        H,
        without(chat(messages=[{"role": "user", "content": "y" * MAX_MODEL_LEN}]), "max_tokens"),
        400,
        "context_length_exceeded",
        "messages",
    ),
    Case(
        "prompt alone over the context",
        C,
        without(completion(prompt="y" * MAX_MODEL_LEN), "max_tokens"),
        400,
        "context_length_exceeded",
        "prompt",
    ),
    # Sampling values.
    Case("temperature negative", C, completion(temperature=-0.1), 400, "invalid_value", "temperature"),
    Case("temperature a string", H, chat(temperature="hot"), 400, "invalid_type", "temperature"),
    Case("top_p zero", C, completion(top_p=0), 400, "invalid_value", "top_p"),
    Case("top_p above one", H, chat(top_p=1.5), 400, "invalid_value", "top_p"),
    Case("top_k below -1", C, completion(top_k=-2), 400, "invalid_value", "top_k"),
    Case("min_p above one", C, completion(min_p=2), 400, "invalid_value", "min_p"),
    Case("seed a string", C, completion(seed="abc"), 400, "invalid_type", "seed"),
    Case("seed beyond int64", C, completion(seed=2**64), 400, "invalid_value", "seed"),
    Case("stop a number", H, chat(stop=5), 400, "invalid_type", "stop"),
    Case("stop empty string", C, completion(stop=[""]), 400, "invalid_value", "stop"),
    Case("stream a string", C, completion(stream="yes"), 400, "invalid_type", "stream"),
    Case(
        "stream_options without stream",
        H,
        chat(stream_options={"include_usage": True}),
        400,
        "invalid_value",
        "stream_options",
    ),
    Case(
        "stream_options unknown key",
        H,
        chat(stream=True, stream_options={"every": 1}),
        400,
        "unknown_parameter",
        "stream_options.every",
    ),
    Case("ignore_eos a string", C, completion(ignore_eos="true"), 400, "invalid_type", "ignore_eos"),
    Case("user a number", H, chat(user=5), 400, "invalid_type", "user"),
    Case("completion logprobs too many", C, completion(logprobs=21), 400, "invalid_value", "logprobs"),
    Case("completion logprobs a boolean", C, completion(logprobs=True), 400, "invalid_type", "logprobs"),
    Case("chat logprobs a number", H, chat(logprobs=2), 400, "invalid_type", "logprobs"),
    Case("top_logprobs without logprobs", H, chat(top_logprobs=2), 400, "invalid_value", "top_logprobs"),
    # Fields this server does not implement: refused by name, never ignored.
    Case("n above one", C, completion(n=2), 400, "unsupported_parameter", "n"),
    Case("n zero", H, chat(n=0), 400, "unsupported_parameter", "n"),
    Case(
        "tools",
        H,
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "unsupported_parameter",
        "tools",
    ),
    Case("functions", H, chat(functions=[{"name": "f"}]), 400, "unsupported_parameter", "functions"),
    Case(
        "response_format",
        H,
        chat(response_format={"type": "json_object"}),
        400,
        "unsupported_parameter",
        "response_format",
    ),
    Case("logit_bias", C, completion(logit_bias={"50": 5}), 400, "unsupported_parameter", "logit_bias"),
    Case("best_of", C, completion(best_of=2), 400, "unsupported_parameter", "best_of"),
    Case("suffix", C, completion(suffix="!"), 400, "unsupported_parameter", "suffix"),
    Case("echo", C, completion(echo=True), 400, "unsupported_parameter", "echo"),
    Case("presence_penalty", H, chat(presence_penalty=0.5), 400, "unsupported_parameter", "presence_penalty"),
    Case("an unknown field", C, completion(temprature=0.5), 400, "unknown_parameter", "temprature"),
    # Engine-side refusals.
    Case("token id outside the vocabulary", C, completion(prompt=[1, 300]), 400, "invalid_value"),
    Case(
        "rejected while streaming is still JSON",
        C,
        completion(prompt=[300], stream=True),
        400,
        "invalid_value",
    ),
    # Names and routes.
    Case("unknown model", C, completion(model="gpt-5"), 404, "model_not_found", "model"),
    Case("unknown model chat", H, chat(model="nope"), 404, "model_not_found", "model"),
    Case("unknown route", "/v1/embeddings", completion(), 404, "not_found"),
    Case("wrong method", C, b"", 405, "method_not_allowed", method="GET"),
]


@pytest.fixture(scope="module")
def strict_server() -> Iterator[LiveServer]:
    with live_server(options=SimOptions(max_model_len=MAX_MODEL_LEN), max_body_bytes=MAX_BODY) as live:
        yield live


def _send(http: httpx.Client, case: Case) -> httpx.Response:
    if isinstance(case.body, bytes):
        return http.request(
            case.method,
            case.path,
            content=case.body,
            headers={"content-type": "application/json", **case.headers},
        )
    return http.request(case.method, case.path, json=case.body, headers=case.headers)


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_request_gets_an_openai_error(strict_server: LiveServer, case: Case) -> None:
    with strict_server.http() as http:
        response = _send(http, case)
    assert response.status_code == case.status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == case.code
    if case.param is not None:
        assert error["param"] == case.param


def test_after_every_bad_request_the_server_is_healthy_and_holds_nothing(strict_server: LiveServer) -> None:
    with strict_server.http() as http:
        statuses = [_send(http, case).status_code for case in CASES]
        assert all(400 <= s < 500 for s in statuses)
        good = http.post(C, json=completion(max_tokens=3, ignore_eos=True))
        assert good.status_code == 200
        assert http.get("/health").status_code == 200
    load = strict_server.wait_idle()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 1},
        {"presence_penalty": 0, "frequency_penalty": 0.0},
        {"logit_bias": None, "tools": None, "response_format": {"type": "text"}},
        {"top_k": -1, "user": "someone", "seed": -3},
        {"max_tokens": 4, "max_completion_tokens": 4},
    ],
    ids=["n=1", "zero penalties", "nulls and text format", "vllm no-top-k", "agreeing lengths"],
)
def test_no_op_values_of_unsupported_fields_are_accepted(
    strict_server: LiveServer, fields: dict[str, object]
) -> None:
    with strict_server.http() as http:
        response = http.post(H, json=chat(**fields))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_request_that_never_fits_the_kv_cache_is_refused_with_400() -> None:
    # 9 pages (one is padding) hold 128 tokens; a 200-token prompt could never run.
    with live_server(options=SimOptions(num_kv_pages=9, max_model_len=1024)) as live, live.http() as http:
        for stream in (False, True):
            response = http.post(C, json=completion(prompt="z" * 200, max_tokens=10, stream=stream))
            assert response.status_code == 400
            assert response.headers["content-type"].startswith("application/json")
            assert response.json()["error"]["code"] == "kv_cache_capacity_exceeded"
        assert http.post(C, json=completion(prompt="z" * 50, max_tokens=10)).status_code == 200
        load = live.wait_idle()
        assert load.kv_pages_used == 0


def test_oversized_body_without_content_length_is_refused(strict_server: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    with strict_server.http() as http:
        response = http.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    # The upload was chunked: the limit held while reading, with no declared length to check first.
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"


def test_invalid_json_is_refused_whatever_the_content_type(strict_server: LiveServer) -> None:
    with strict_server.http() as http:
        response = http.post(
            C, content=json.dumps({"prompt": "a"})[:-1], headers={"content-type": "text/plain"}
        )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
