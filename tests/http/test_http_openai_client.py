"""The official `openai` client against a real server: completions and chat, streaming and not."""

from __future__ import annotations

import httpx
import openai
import pytest
from http_support import LiveServer, live_server

from engine.contract import FinishReason, SamplingParams
from models.registry import ChatMessage
from models.sim import SimCompletion, SimTokenizer, sim_completion

TOK = SimTokenizer()


def expect(prompt_ids: list[int], **sampling: object) -> SimCompletion:
    return sim_completion(prompt_ids, SamplingParams(**sampling))  # type: ignore[arg-type]


def chat_ids(*messages: tuple[str, str]) -> list[int]:
    return TOK.render_chat([ChatMessage(role, content) for role, content in messages])


def seed_ending_on_eos(prompt_ids: list[int], max_tokens: int) -> tuple[int, SimCompletion]:
    """A seed for which the sim stops on EOS (finish_reason 'stop') before max_tokens."""
    for seed in range(1000):
        done = expect(prompt_ids, max_tokens=max_tokens, seed=seed)
        if done.finish_reason is FinishReason.STOP and len(done.token_ids) >= 3:
            return seed, done
    raise AssertionError("no seed ends on EOS")


def test_completion_returns_exactly_the_sim_text(sim_server: LiveServer) -> None:
    client = sim_server.client()
    prompt = "The quick brown fox"
    result = client.completions.create(
        model="sim", prompt=prompt, max_tokens=40, seed=7, extra_body={"ignore_eos": True}
    )
    want = expect(TOK.encode(prompt), max_tokens=40, seed=7, ignore_eos=True)
    assert result.object == "text_completion"
    assert result.model == "sim"
    assert result.choices[0].text == want.text
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (
        len(prompt),
        40,
        len(prompt) + 40,
    )


def test_completion_accepts_token_id_prompts(sim_server: LiveServer) -> None:
    ids = TOK.encode("token ids in, text out")
    result = sim_server.client().completions.create(model="sim", prompt=ids, max_tokens=12, seed=1)
    assert result.choices[0].text == expect(ids, max_tokens=12, seed=1).text


def test_streamed_completion_concatenates_to_the_sim_text(sim_server: LiveServer) -> None:
    client = sim_server.client()
    prompt = "stream me a completion"
    chunks = list(
        client.completions.create(
            model="sim",
            prompt=prompt,
            max_tokens=50,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert (
        "".join(c.choices[0].text for c in text_chunks)
        == expect(TOK.encode(prompt), max_tokens=50, seed=3, ignore_eos=True).text
    )
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 50
    assert usage_chunk.usage.prompt_tokens == len(prompt)


def test_chat_returns_exactly_the_sim_text(sim_server: LiveServer) -> None:
    messages = [("system", "be brief"), ("user", "hello there")]
    result = sim_server.client().chat.completions.create(
        model="sim",
        messages=[{"role": r, "content": c} for r, c in messages],  # type: ignore[misc]
        max_completion_tokens=30,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    want = expect(chat_ids(*messages), max_tokens=30, seed=11, ignore_eos=True)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == want.text
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(chat_ids(*messages))
    assert result.usage.completion_tokens == 30


def test_streamed_chat_opens_with_the_role_and_ends_with_usage(sim_server: LiveServer) -> None:
    stream = sim_server.client().chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "stream a chat"}],
        max_tokens=25,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    want = expect(chat_ids(("user", "stream a chat")), max_tokens=25, seed=5)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.finish_reason.value]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_stream_without_include_usage_sends_no_usage_chunk(sim_server: LiveServer) -> None:
    chunks = list(
        sim_server.client().chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "no usage please"}], max_tokens=5, stream=True
        )
    )
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


def test_sse_wire_format_ends_with_done(sim_server: LiveServer) -> None:
    body = {"prompt": "wire", "max_tokens": 4, "stream": True}
    with sim_server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_eos_gives_finish_reason_stop_and_ignore_eos_runs_to_length(sim_server: LiveServer) -> None:
    client = sim_server.client()
    prompt = "stop on eos"
    seed, want = seed_ending_on_eos(TOK.encode(prompt), max_tokens=200)
    stopped = client.completions.create(model="sim", prompt=prompt, max_tokens=200, seed=seed)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == want.text
    assert stopped.usage is not None and stopped.usage.completion_tokens == len(want.token_ids)
    forced = client.completions.create(
        model="sim", prompt=prompt, max_tokens=200, seed=seed, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].finish_reason == "length"
    assert forced.usage is not None and forced.usage.completion_tokens == 200
    assert forced.choices[0].text.startswith(want.text)


def test_seeds_select_different_sim_outputs(sim_server: LiveServer) -> None:
    client = sim_server.client()
    texts = {
        seed: client.completions.create(
            model="sim", prompt="same prompt", max_tokens=20, seed=seed, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for seed in (1, 2)
    }
    for seed, text in texts.items():
        assert text == expect(TOK.encode("same prompt"), max_tokens=20, seed=seed, ignore_eos=True).text
    assert texts[1] != texts[2]


def test_repeated_prompt_reports_cached_tokens(sim_server: LiveServer) -> None:
    client = sim_server.client()
    prompt = "a prompt long enough to fill a few sixteen-token pages of KV cache " * 2
    first = client.completions.create(model="sim", prompt=prompt, max_tokens=4)
    second = client.completions.create(model="sim", prompt=prompt, max_tokens=4)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Full 16-token pages only, and never the whole prompt (its last token must be computed).
    assert second.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert second.choices[0].text == first.choices[0].text


def test_completion_logprobs_shape(sim_server: LiveServer) -> None:
    prompt = "logprobs please"
    result = sim_server.client().completions.create(
        model="sim", prompt=prompt, max_tokens=6, logprobs=3, seed=2, extra_body={"ignore_eos": True}
    )
    want = expect(TOK.encode(prompt), max_tokens=6, seed=2, logprobs=3, ignore_eos=True)
    assert want.logprobs is not None
    lp = result.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert lp.tokens == [chr(t) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs])
    assert lp.text_offset == list(range(6))
    for top, expected in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert top == pytest.approx({chr(t): v for t, v in expected.top[:3]})
        assert len(top) == 3


def test_streamed_completion_logprobs_cover_every_token(sim_server: LiveServer) -> None:
    chunks = list(
        sim_server.client().completions.create(
            model="sim",
            prompt="lp stream",
            max_tokens=9,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in chunks:
        lp = chunk.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.text_offset is not None
        tokens.extend(lp.tokens)
        offsets.extend(lp.text_offset)
    assert "".join(tokens) == "".join(c.choices[0].text for c in chunks)
    assert offsets == list(range(9))


def test_chat_logprobs_shape(sim_server: LiveServer) -> None:
    messages = [("user", "chat logprobs")]
    result = sim_server.client().chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "chat logprobs"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        seed=9,
        extra_body={"ignore_eos": True},
    )
    want = expect(chat_ids(*messages), max_tokens=5, seed=9, logprobs=2, ignore_eos=True)
    assert want.logprobs is not None
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    assert len(content) == 5
    for entry, expected in zip(content, want.logprobs, strict=True):
        assert entry.token == chr(expected.token_id)
        assert entry.bytes == [expected.token_id]
        assert entry.logprob == pytest.approx(expected.logprob)
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (chr(t), pytest.approx(v)) for t, v in expected.top[:2]
        ]


def test_chat_without_logprobs_has_none(sim_server: LiveServer) -> None:
    result = sim_server.client().chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "x"}], max_tokens=3
    )
    assert result.choices[0].logprobs is None


def test_models_lists_the_served_model(sim_server: LiveServer) -> None:
    models = sim_server.client().models.list()
    assert [m.id for m in models.data] == ["sim"]
    raw = httpx.get(f"{sim_server.url}/v1/models").json()
    assert raw["data"][0]["max_model_len"] == sim_server.model.max_model_len


def test_health_is_ok_while_the_driver_runs(sim_server: LiveServer) -> None:
    response = httpx.get(f"{sim_server.url}/health")
    assert response.status_code == 200
    assert sim_server.engine.healthy


def test_metrics_use_vllm_names_with_a_model_name_label(sim_server: LiveServer) -> None:
    sim_server.client().completions.create(
        model="sim", prompt="count me", max_tokens=3, extra_body={"ignore_eos": True}
    )
    sim_server.wait_idle()
    text = httpx.get(f"{sim_server.url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert f"{name}{{" in text, name
        assert sim_server.metric(name, model_name="sim") >= 0
    assert sim_server.metric("vllm:request_success_total", model_name="sim", finished_reason="length") >= 1
    assert sim_server.metric("vllm:generation_tokens_total", model_name="sim") >= 3


def test_served_model_name_is_the_only_name_accepted() -> None:
    with live_server(served_model_name="my-sim") as live:
        client = live.client()
        assert client.completions.create(model="my-sim", prompt="hi", max_tokens=2).model == "my-sim"
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="sim", prompt="hi", max_tokens=2)
        assert caught.value.status_code == 404


def test_api_key_is_required_on_v1_routes_only() -> None:
    with live_server(api_key="s3cret") as live:
        assert live.client().completions.create(model="sim", prompt="hi", max_tokens=2).choices[0].text
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as caught:
                bad.completions.create(model="sim", prompt="hi", max_tokens=2)
            assert caught.value.status_code == 401
        for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
            method = "GET" if path == "/v1/models" else "POST"
            response = httpx.request(method, f"{live.url}{path}", json={})
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        basic = httpx.get(f"{live.url}/v1/models", headers={"Authorization": "Basic s3cret"})
        assert basic.status_code == 401
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert httpx.get(f"{live.url}/metrics").status_code == 200
