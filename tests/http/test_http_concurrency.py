"""256 concurrent streaming chats against sim: exact texts, and nothing left behind afterwards."""

from __future__ import annotations

import asyncio

import openai
import pytest
from http_support import LiveServer, live_server

from engine.config import EngineConfig
from engine.contract import SamplingParams
from engine.scheduler import BatchScheduler
from models.registry import ChatMessage
from models.sim import SimOptions, SimTokenizer, sim_completion

TOK = SimTokenizer()
NUM_STREAMS = 256


def _question(i: int) -> str:
    # Distinct from the first character on, so no two prompts share a prefix-cache page.
    return f"{i:03d} tell me something about the number {i}"


def _sampling(i: int) -> SamplingParams:
    # A mix: some stop on EOS, some run to length; different lengths and seeds.
    return SamplingParams(max_tokens=16 + i % 24, seed=i, ignore_eos=i % 3 == 0)


async def _one_chat(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int | None]:
    sampling = _sampling(i)
    stream = await client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": _question(i)}],
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": sampling.ignore_eos},
    )
    text: list[str] = []
    finish: str | None = None
    completion_tokens: int | None = None
    async for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, completion_tokens


async def _run_all(live: LiveServer) -> list[tuple[str, str | None, int | None]]:
    client = live.async_client()
    try:
        return await asyncio.gather(*(_one_chat(client, i) for i in range(NUM_STREAMS)))
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("options", "preempts"),
    [
        pytest.param(SimOptions(), False, id="roomy"),
        # Few pages and a small step budget: requests queue, prefill in chunks and get preempted,
        # and must still produce exactly the same text.
        pytest.param(
            SimOptions(engine=EngineConfig(max_num_seqs=96, max_num_batched_tokens=256), num_kv_pages=48),
            True,
            id="tight",
        ),
    ],
)
def test_256_concurrent_streaming_chats_get_exactly_the_sim_text(options: SimOptions, preempts: bool) -> None:
    with live_server(options=options) as live:
        results = asyncio.run(_run_all(live))
        for i, (text, finish, completion_tokens) in enumerate(results):
            prompt = TOK.render_chat([ChatMessage("user", _question(i))])
            want = sim_completion(prompt, _sampling(i))
            assert text == want.text, f"stream {i}"
            assert finish == want.finish_reason.value, f"stream {i}"
            assert completion_tokens == len(want.token_ids), f"stream {i}"
        assert {f for _, f, _ in results} == {"stop", "length"}
        scheduler = live.model.scheduler
        assert isinstance(scheduler, BatchScheduler)
        assert (scheduler.num_preemptions > 0) == preempts

        load = live.wait_idle()
        assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)
        direct = live.model.scheduler.load()  # the driver is idle: nothing races this read
        assert (direct.running, direct.waiting, direct.kv_pages_used) == (0, 0, 0)
        assert live.metric("vllm:num_requests_running", model_name="sim") == 0
        assert live.metric("vllm:num_requests_waiting", model_name="sim") == 0
        assert live.metric("vllm:kv_cache_usage_perc", model_name="sim") == 0
        assert live.metric("infer:kv_pages_used", model_name="sim") == 0
        ended = sum(
            live.metric("vllm:request_success_total", model_name="sim", finished_reason=reason)
            for reason in ("stop", "length")
        )
        assert ended == NUM_STREAMS
        generated = sum(n or 0 for _, _, n in results)
        assert live.metric("vllm:generation_tokens_total", model_name="sim") == generated
