"""Failures inside the engine: a failed step errors its batch and nothing else; a dead driver fails
every open request and turns /health to 503."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from http_support import LiveServer, live_server, spied_server

from engine.contract import SamplingParams
from engine.runner import StepBatch
from models.sim import SimOptions, SimTokenizer, sim_completion

TOK = SimTokenizer()
LONG = 400


class StepFault:
    """A sim fault hook that fails the next step after it is armed, and remembers that batch."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.failed_batches: list[set[str]] = []

    def __call__(self, batch: StepBatch) -> None:
        if self.armed.is_set():
            self.armed.clear()
            self.failed_batches.append({row.request_id for row in batch.rows})
            raise RuntimeError("injected step failure")


def _events(raw: str) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.split("\n\n") if e]


async def _post(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], seen: list[str]
) -> tuple[int, Any, str]:
    """(status, JSON body or list of SSE payloads, request id). SSE payloads are appended to `seen`
    as they arrive, so a test can act while the stream is flowing."""
    if not body.get("stream"):
        response = await client.post(path, json=body)
        return response.status_code, response.json(), response.headers["x-request-id"]
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raw = (await response.aread()).decode()
            return response.status_code, json.loads(raw), response.headers.get("x-request-id", "")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen.append(line.removeprefix("data: "))
    return response.status_code, seen, response.headers["x-request-id"]


def _bodies(tag: str, max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    common = {"max_tokens": max_tokens, "ignore_eos": True}
    return [
        ("/v1/completions", {"prompt": f"{tag} plain", **common}),
        ("/v1/completions", {"prompt": f"{tag} streamed", "stream": True, **common}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"{tag} chat"}], **common}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": f"{tag} chat streamed"}], "stream": True, **common},
        ),
    ]


async def _concurrently(
    live: LiveServer,
    bodies: list[tuple[str, dict[str, Any]]],
    meanwhile: Callable[[list[list[str]]], Awaitable[None]],
) -> list[tuple[int, Any, str]]:
    seen: list[list[str]] = [[] for _ in bodies]
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
        tasks = [
            asyncio.create_task(_post(client, path, body, events))
            for (path, body), events in zip(bodies, seen, strict=True)
        ]
        await meanwhile(seen)
        return await asyncio.gather(*tasks)


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.002)


def _assert_failed(status: int, payload: Any, stream: bool, code: str) -> None:
    if not stream:
        assert status == 500
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert payload["error"]["code"] == code
        return
    # Streaming: the 200 was sent long ago; the failure is an error event, then [DONE].
    assert status == 200
    assert payload[-1] == "[DONE]"
    error = json.loads(payload[-2])["error"]
    assert error["code"] == code and error["message"]


def _expected_text(path: str, body: dict[str, Any]) -> str:
    if path == "/v1/completions":
        prompt = TOK.encode(body["prompt"])
    else:
        from models.registry import ChatMessage

        prompt = TOK.render_chat([ChatMessage(m["role"], m["content"]) for m in body["messages"]])
    return sim_completion(prompt, SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True)).text


def _text_of(path: str, payload: Any, stream: bool) -> str:
    if not stream:
        choice = payload["choices"][0]
        return str(choice["text"] if path == "/v1/completions" else choice["message"]["content"])
    assert payload[-1] == "[DONE]"
    pieces = []
    for event in payload[:-1]:
        for choice in json.loads(event)["choices"]:
            pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(pieces)


def test_a_failed_step_errors_its_batch_and_the_next_requests_succeed() -> None:
    fault = StepFault()
    with live_server(options=SimOptions(step_delay_s=0.003), fault=fault) as live:
        first = _bodies("doomed", LONG)

        async def fail_once_all_run(seen: list[list[str]]) -> None:
            await _until(lambda: live.engine.load.running == len(first))
            # The streams are flowing: each has its opening chunk and some text.
            await _until(lambda: all(len(seen[i]) >= 3 for i in (1, 3)))
            fault.armed.set()

        results = asyncio.run(_concurrently(live, first, fail_once_all_run))
        assert len(fault.failed_batches) == 1
        assert fault.failed_batches[0] == {rid for _, _, rid in results}
        for (_, body), (status, payload, _) in zip(first, results, strict=True):
            _assert_failed(status, payload, bool(body.get("stream")), "engine_failure")
        for _, payload, _ in results[1::2]:
            assert len(payload) > 3, "the streams were mid-flight when the step failed"

        second = _bodies("fine", 20)

        async def nothing(_: list[list[str]]) -> None:
            return None

        for (path, body), (status, payload, _) in zip(
            second, asyncio.run(_concurrently(live, second, nothing)), strict=True
        ):
            assert status == 200
            assert _text_of(path, payload, bool(body.get("stream"))) == _expected_text(path, body)

        load = live.wait_idle()
        assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert live.metric("infer:request_errors_total", model_name="sim", kind="failed") == len(first)


def test_a_failure_in_the_first_step_still_streams_an_error_event() -> None:
    fault = StepFault()
    with live_server(fault=fault) as live, live.http() as http:
        fault.armed.set()
        with http.stream(
            "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True}
        ) as response:
            assert response.status_code == 200
            events = _events(response.read().decode())
        assert events[-1] == "[DONE]"
        assert len(events) == 2
        assert json.loads(events[0])["error"]["code"] == "engine_failure"
        fault.armed.set()
        plain = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert plain.status_code == 500
        assert plain.json()["error"]["type"] == "server_error"
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}).status_code == 200
        assert live.wait_idle().kv_pages_used == 0


def test_a_dead_driver_fails_every_open_request_and_health_turns_503(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with spied_server(SimOptions(step_delay_s=0.003)) as (live, spy):
        bodies = _bodies("orphaned", LONG)

        async def kill_once_all_run(_: list[list[str]]) -> None:
            await _until(lambda: live.engine.load.running == len(bodies))
            spy.die = True

        results = asyncio.run(_concurrently(live, bodies, kill_once_all_run))
        for (_, body), (status, payload, _) in zip(bodies, results, strict=True):
            stream = bool(body.get("stream"))
            if not stream:
                assert status == 500
                assert "injected fatal" in payload["error"]["message"]
            _assert_failed(status, payload, stream, "engine_failure")

        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503
        error = health.json()["error"]
        # One line for the client, OpenAI-shaped; the traceback is in the server's log only.
        assert (
            error["message"] == "driver stopped: RuntimeError: injected fatal: the scheduler cannot recover"
        )
        assert (error["type"], error["code"]) == ("service_unavailable_error", "engine_unhealthy")
        assert "Traceback" not in health.text
        logged = [r.getMessage() for r in caplog.records if r.name == "infer.driver"]
        assert any("Traceback" in m and "injected fatal" in m for m in logged), logged
        refused = httpx.post(f"{live.url}/v1/completions", json={"prompt": "anyone?", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_dead"
        assert "\n" not in refused.json()["error"]["message"] and "Traceback" not in refused.text
        assert live.engine.counters.open_streams == 0
