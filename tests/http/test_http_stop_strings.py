"""Stop strings over HTTP: the text is cut before the stop string, finish_reason is "stop", the
usage counts the tokens generated up to it, and the engine stops generating for the request."""

from __future__ import annotations

from http_support import LiveServer, spied_server

from engine.contract import SamplingParams
from models.registry import ChatMessage
from models.sim import SimOptions, SimTokenizer, sim_completion

TOK = SimTokenizer()
MAX_TOKENS = 80


def _full_text(prompt_ids: list[int], seed: int) -> str:
    return sim_completion(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, seed=seed, ignore_eos=True)).text


def test_stop_string_cuts_a_completion(sim_server: LiveServer) -> None:
    prompt = "stop somewhere in the middle"
    full = _full_text(TOK.encode(prompt), seed=4)
    stop = full[30:33]
    cut = full.find(stop)
    result = sim_server.client().completions.create(
        model="sim", prompt=prompt, max_tokens=MAX_TOKENS, seed=4, stop=stop, extra_body={"ignore_eos": True}
    )
    assert result.choices[0].text == full[:cut]
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None
    # The sim's tokenizer is byte-level: one token per character, up to the end of the stop string.
    assert result.usage.completion_tokens == cut + len(stop)
    load = sim_server.wait_idle()
    assert load.kv_pages_used == 0
    assert sim_server.metric("vllm:request_success_total", model_name="sim", finished_reason="stop") >= 1


def test_stop_string_aborts_the_request_in_the_engine() -> None:
    # Slow steps, so the engine is still far from max_tokens when the stop string shows up.
    max_tokens = 2000
    with spied_server(SimOptions(step_delay_s=0.002)) as (live, spy):
        full = sim_completion(
            TOK.encode("abort on stop"), SamplingParams(max_tokens=max_tokens, seed=1, ignore_eos=True)
        ).text
        stop = full[20:23]
        result = live.client().completions.create(
            model="sim",
            prompt="abort on stop",
            max_tokens=max_tokens,
            seed=1,
            stop=stop,
            extra_body={"ignore_eos": True},
        )
        assert result.choices[0].finish_reason == "stop"
        live.wait_idle()
        assert [a[0] for a in spy.aborts] == [spy.submitted[0].request_id]
        assert live.engine.counters.aborted == 1
        # The engine stopped within a few steps of the stop string, not at max_tokens.
        assert len(spy.steps) < 1000


def test_streamed_stop_string_never_leaks_into_the_stream(sim_server: LiveServer) -> None:
    question = "stream until the stop"
    prompt = TOK.render_chat([ChatMessage("user", question)])
    full = _full_text(prompt, seed=8)
    stops = [full[50:54], full[25:27]]
    cut = min(full.find(s) for s in stops)
    # Generation stops on the token that completes the first stop string to appear.
    tokens = min(full.find(s) + len(s) for s in stops)
    chunks = list(
        sim_server.client().chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            seed=8,
            stop=stops,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == full[:cut]
    sent = ""
    for piece in pieces:
        sent += piece
        assert full.startswith(sent) and len(sent) <= cut
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == tokens


def test_stop_string_that_never_appears_changes_nothing(sim_server: LiveServer) -> None:
    prompt = "no stop here"
    full = _full_text(TOK.encode(prompt), seed=2)
    absent = "\u00e9\u00e9"  # the sim only writes printable ASCII
    stream = sim_server.client().completions.create(
        model="sim",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        seed=2,
        stop=[absent],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_at_the_very_start_gives_empty_text(sim_server: LiveServer) -> None:
    prompt = "stop at once"
    full = _full_text(TOK.encode(prompt), seed=6)
    result = sim_server.client().completions.create(
        model="sim",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        seed=6,
        stop=full[:2],
        extra_body={"ignore_eos": True},
    )
    assert result.choices[0].text == ""
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None and result.usage.completion_tokens == 2
