"""The sim model line: tokenizer, the completion rule, the runner's paged KV, and registration."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from engine.config import EngineConfig
from engine.contract import FinishReason, Request, SamplingParams
from engine.kv import KVGroupSpec
from engine.runner import BatchRow, StepBatch
from models.registry import ChatMessage, ModelOptions, load_model
from models.sim import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    TURN_START_TOKEN_ID,
    SimKVError,
    SimOptions,
    SimRunner,
    SimTokenizer,
    build_sim,
    sim_completion,
)

# -- tokenizer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld ✓ 🚀\n\t<eos>", "a" * 300])
def test_text_round_trips_exactly(text: str) -> None:
    tok = SimTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_decode_skips_special_tokens() -> None:
    tok = SimTokenizer()
    assert tok.decode([BOS_TOKEN_ID, *tok.encode("hi"), EOS_TOKEN_ID]) == "hi"


def test_chat_template_begins_with_bos_and_ends_with_the_assistant_turn() -> None:
    tok = SimTokenizer()
    ids = tok.render_chat([ChatMessage("system", "be brief"), ChatMessage("user", "2+2?")])
    assert ids[0] == BOS_TOKEN_ID and ids.count(BOS_TOKEN_ID) == 1
    assert ids.count(TURN_START_TOKEN_ID) == 3
    assert ids[-len("assistant\n") - 1 :] == [TURN_START_TOKEN_ID, *tok.encode("assistant\n")]
    assert "user\n2+2?" in tok.decode(ids)


# -- the completion rule -------------------------------------------------------------------------


def test_completion_is_deterministic_and_seeded() -> None:
    prompt = tuple(b"The quick brown fox")
    base = sim_completion(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    assert base == sim_completion(prompt, SamplingParams(max_tokens=40, ignore_eos=True, seed=0))
    other = sim_completion(prompt, SamplingParams(max_tokens=40, ignore_eos=True, seed=7))
    assert other.token_ids != base.token_ids
    assert all(32 <= t <= 126 for t in base.token_ids + other.token_ids)
    assert base.text == bytes(base.token_ids).decode()
    # A different history gives a different continuation.
    assert sim_completion((*prompt, 33), SamplingParams(max_tokens=40, ignore_eos=True)) != base


def test_both_finish_reasons_happen_and_ignore_eos_never_stops_early() -> None:
    reasons: Counter[FinishReason] = Counter()
    for i in range(200):
        prompt = tuple(f"prompt number {i}".encode())
        done = sim_completion(prompt, SamplingParams(max_tokens=32, seed=i))
        reasons[done.finish_reason] += 1
        assert EOS_TOKEN_ID not in done.token_ids
        if done.finish_reason is FinishReason.STOP:
            assert len(done.token_ids) < 32
        forced = sim_completion(prompt, SamplingParams(max_tokens=64, seed=i, ignore_eos=True))
        assert len(forced.token_ids) == 64 and forced.finish_reason is FinishReason.LENGTH
    assert reasons[FinishReason.STOP] > 20 and reasons[FinishReason.LENGTH] > 20


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_are_deterministic_and_well_formed(k: int) -> None:
    prompt = tuple(b"logprobs please")
    done = sim_completion(prompt, SamplingParams(max_tokens=20, logprobs=k, ignore_eos=True))
    assert done.logprobs is not None and len(done.logprobs) == len(done.token_ids)
    for token, lp in zip(done.token_ids, done.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob < 0
        assert len(lp.top) == k and len({t for t, _ in lp.top}) == k
        if k:
            assert lp.top[0] == (token, lp.logprob)
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
    assert sim_completion(prompt, SamplingParams(max_tokens=20)).logprobs is None


# -- the runner and its paged KV -----------------------------------------------------------------


def _row(
    rid: str, tokens: tuple[int, ...], start: int, table: tuple[int, ...], sample: bool = True
) -> BatchRow:
    return BatchRow(rid, tokens, start, (table,), sample, SamplingParams(), tokens, 0)


def test_runner_reads_history_only_through_the_kv() -> None:
    runner = SimRunner([KVGroupSpec("full", 8)])
    prompt = tuple(range(65, 65 + 20))
    runner.execute(StepBatch((_row("a", prompt[:16], 0, (1,), sample=False),)))
    # The next chunk through the right page continues the same sequence...
    (right,) = runner.execute(StepBatch((_row("a", prompt[16:], 16, (1, 2)),)))
    assert right is not None
    assert right.token_id == sim_completion(prompt, SamplingParams(max_tokens=1)).token_ids[0]
    # ...through another written page (another sequence's KV) it does not.
    runner.execute(StepBatch((_row("b", tuple(range(97, 113)), 0, (3,), sample=False),)))
    (wrong,) = runner.execute(StepBatch((_row("a", prompt[16:], 16, (3, 2)),)))
    assert wrong is not None and wrong.token_id != right.token_id


def test_runner_refuses_impossible_page_tables() -> None:
    runner = SimRunner([KVGroupSpec("full", 8)])
    with pytest.raises(SimKVError, match="padding page"):
        runner.execute(StepBatch((_row("a", (1, 2), 0, (0,)),)))
    with pytest.raises(SimKVError, match="never written"):
        runner.execute(StepBatch((_row("a", (3,), 20, (5, 6)),)))
    with pytest.raises(SimKVError, match="only 1 pages"):
        runner.execute(StepBatch((_row("a", (1,) * 17, 0, (1,)),)))


def test_runner_step_delay_and_fault_hook() -> None:
    seen: list[int] = []

    def fault(batch: StepBatch) -> None:
        seen.append(len(batch.rows))
        if any(r.request_id == "boom" for r in batch.rows):
            raise RuntimeError("injected")

    runner = SimRunner([KVGroupSpec("full", 8)], step_delay_s=0.05, fault=fault)
    t0 = time.perf_counter()
    runner.execute(StepBatch((_row("a", (1, 2), 0, (1,)),)))
    assert time.perf_counter() - t0 >= 0.05
    with pytest.raises(RuntimeError, match="injected"):
        runner.execute(StepBatch((_row("boom", (1, 2), 0, (2,)),)))
    assert seen == [1, 1] and runner.steps == 1


# -- the line ------------------------------------------------------------------------------------


def test_build_sim_serves_the_rule_with_real_kv_accounting() -> None:
    model = build_sim(SimOptions(num_kv_pages=64, max_model_len=512))
    scheduler = model.scheduler
    prompt = model.tokenizer.render_chat([ChatMessage("user", "tell me a story " * 5)])
    sampling = SamplingParams(max_tokens=40, seed=3, ignore_eos=True)
    scheduler.submit(Request("chat", tuple(prompt), sampling))
    tokens: list[int] = []
    pages_seen = []
    while scheduler.has_work():
        for u in scheduler.step().updates:
            tokens.extend(u.new_token_ids)
        pages_seen.append(scheduler.load().kv_pages_used)
    assert tokens == list(sim_completion(prompt, sampling).token_ids)
    # Pages are taken at admission and one more per 16 tokens; all come back at the end.
    assert pages_seen[0] == -(-len(prompt) // 16) + (len(prompt) % 16 == 0)
    assert max(pages_seen) == -(-(len(prompt) + 39) // 16)
    assert pages_seen[-1] == 0 and scheduler.load().kv_pages_total == 63
    assert model.max_model_len == 512 and model.name == "sim"


def test_registry_maps_model_options_onto_sim_options() -> None:
    options = ModelOptions(
        engine=EngineConfig(max_model_len=300, num_kv_pages=100, max_num_seqs=3), sim_step_delay_s=0.03
    )
    model = load_model("sim", options)
    assert model.max_model_len == 300
    assert model.scheduler.load().kv_pages_total == 99
    model.scheduler.submit(Request("long", (1, 2, 3), SamplingParams(max_tokens=298)))
    for i in range(4):
        model.scheduler.submit(Request(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=10)))
    t0 = time.perf_counter()
    (rejected, *admitted) = model.scheduler.step().updates
    assert time.perf_counter() - t0 >= 0.03
    # 3 + 298 tokens is over the 300-token limit; max_num_seqs=3 leaves one waiting.
    assert rejected.request_id == "long" and rejected.terminal is not None
    assert [u.request_id for u in admitted] == ["r0", "r1", "r2"]
    load = model.scheduler.load()
    assert (load.running, load.waiting) == (3, 1)


def test_default_sim_holds_256_chats_of_a_few_hundred_tokens() -> None:
    options = SimOptions()
    (group,) = options.kv_groups()
    assert group.allocatable_pages >= 256 * -(-(400 + 256) // 16)
    assert options.max_model_len == 4096 and options.engine.max_num_seqs >= 256
