"""Client disconnects abort their requests in the engine, at once and completely."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from http_support import LiveServer, spied_server

from engine.config import EngineConfig
from engine.contract import SamplingParams
from models.registry import ChatMessage
from models.sim import SimOptions, SimTokenizer, sim_completion

TOK = SimTokenizer()
NUM_STREAMS = 100
NUM_ABORTED = 50
MAX_TOKENS = 150
# The streams that will be aborted ask for far more, so they are surely still running when their
# client hangs up, however slow the machine.
ABORTED_MAX_TOKENS = 3000
# Chunks an aborting client reads before it hangs up.
READ_BEFORE_ABORT = 3


def _question(i: int) -> str:
    return f"{i:03d} a question that takes a while to answer"


def _max_tokens(i: int) -> int:
    return ABORTED_MAX_TOKENS if i < NUM_ABORTED else MAX_TOKENS


def _sim_text(i: int) -> str:
    prompt = TOK.render_chat([ChatMessage("user", _question(i))])
    return sim_completion(prompt, SamplingParams(max_tokens=_max_tokens(i), seed=i, ignore_eos=True)).text


async def _chat(client: openai.AsyncOpenAI, i: int, hang_up: bool) -> tuple[str, str, float | None]:
    """Returns (request id, text received, when the client hung up)."""
    stream = await client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": _question(i)}],
        max_tokens=_max_tokens(i),
        seed=i,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    request_id = ""
    text: list[str] = []
    contents = 0
    async for chunk in stream:
        request_id = chunk.id
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
                contents += 1
        if hang_up and contents >= READ_BEFORE_ABORT:
            await stream.close()
            return request_id, "".join(text), time.monotonic()
    return request_id, "".join(text), None


async def _run(live: LiveServer, streams: range, hang_up: range) -> list[tuple[str, str, float | None]]:
    client = live.async_client()
    try:
        return await asyncio.gather(*(_chat(client, i, i in hang_up) for i in streams))
    finally:
        await client.close()


def test_fifty_streams_aborted_mid_flight() -> None:
    with spied_server(SimOptions(step_delay_s=0.002)) as (live, spy):
        survivors = range(NUM_ABORTED, NUM_STREAMS)
        # The survivors alone, with nobody hanging up around them: the undisturbed run.
        undisturbed = asyncio.run(_run(live, survivors, hang_up=range(0)))
        live.wait_idle()
        steps_before = len(spy.steps)
        disturbed = asyncio.run(_run(live, range(NUM_STREAMS), hang_up=range(NUM_ABORTED)))
        load = live.wait_idle()

        aborted_ids = {rid for rid, _, hung_up in disturbed if hung_up is not None}
        assert len(aborted_ids) == NUM_ABORTED
        with spy.lock:
            aborts = list(spy.aborts)
            steps = list(spy.steps[steps_before:])
            abort_step = dict(spy.abort_step)

        # Every hang-up reached the scheduler, exactly once, while the request was running, and
        # its pages came back inside that very abort call: before any further step.
        assert {a[0] for a in aborts} == aborted_ids
        assert len(aborts) == NUM_ABORTED
        for rid, pages_before, pages_after, running_before, running_after in aborts:
            assert pages_after < pages_before, rid
            assert running_after == running_before - 1, rid

        # No aborted request got a token or a terminal from any step after its abort, nor a terminal
        # ever (an aborted request retires silently).
        for index, with_tokens, with_terminal in steps:
            for rid in aborted_ids:
                assert rid not in with_terminal
                if index >= abort_step[rid]:
                    assert rid not in with_tokens, f"{rid} got a token in step {index}, after its abort"
        # What each hung-up client did read was a true prefix of its answer.
        for i in range(NUM_ABORTED):
            text = disturbed[i][1]
            assert text and _sim_text(i).startswith(text)
            assert len(text) < ABORTED_MAX_TOKENS

        # The survivors' tokens are those of the undisturbed run, which are the sim's.
        for i, (_, text, _) in zip(survivors, undisturbed, strict=True):
            assert disturbed[i][1] == text == _sim_text(i), f"stream {i}"

        assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)
        assert (
            live.metric("vllm:request_success_total", model_name="sim", finished_reason="abort")
            == NUM_ABORTED
        )
        assert live.metric("infer:kv_pages_used", model_name="sim") == 0


@pytest.mark.parametrize("where", ["running", "waiting"])
def test_non_streaming_disconnect_aborts(where: str) -> None:
    # One running slot: a blocker holds it, so a second request waits in the queue.
    with spied_server(SimOptions(engine=EngineConfig(max_num_seqs=1), step_delay_s=0.002)) as (live, spy):
        blocker_done = threading.Event()
        blocker_text: list[str] = []

        def blocker() -> None:
            result = live.client().completions.create(
                model="sim", prompt="blocker", max_tokens=300, extra_body={"ignore_eos": True}
            )
            blocker_text.append(result.choices[0].text)
            blocker_done.set()

        if where == "waiting":
            threading.Thread(target=blocker, daemon=True).start()
            while live.engine.load.running == 0:
                time.sleep(0.005)
        body = {"prompt": "hang up on me", "max_tokens": 1000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout), live.http() as http:
            http.post("/v1/completions", json=body, timeout=0.3)
        hung_up = time.monotonic()
        while not spy.aborts:
            assert time.monotonic() - hung_up < 5, "the hang-up never reached the scheduler"
            time.sleep(0.005)
        rid, pages_before, pages_after, running_before, running_after = spy.aborts[0]
        if where == "running":
            assert pages_after < pages_before
            assert running_after == running_before - 1
        else:
            assert pages_after == pages_before, "a waiting request holds no pages"
            assert running_after == running_before == 1
            assert blocker_done.wait(30)
            assert (
                blocker_text[0]
                == sim_completion(TOK.encode("blocker"), SamplingParams(max_tokens=300, ignore_eos=True)).text
            )
        load = live.wait_idle()
        assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)
        assert rid.startswith("cmpl-")
