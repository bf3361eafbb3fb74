"""Lifecycle at the model level: cancellation frees pages and the state slot, slots never leak,
and the context limit refuses rather than truncates."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Finished, FinishReason, Rejected, RejectReason, Request
from gates.harness.serving import Completion, batch_scheduler, drive, greedy, load_for_gate, random_prompt
from models.qwen35.config import Qwen35Config


def test_cancel_frees_pages_and_slots(checkpoint_path: Path, qwen35_config: Qwen35Config) -> None:
    served = load_for_gate(checkpoint_path)
    requests = [
        Request(
            f"r{i}", random_prompt(40 + 9 * i, seed=70 + i, vocab_size=qwen35_config.vocab_size), greedy(32)
        )
        for i in range(3)
    ]
    seen_at_abort: dict[str, int] = {}

    def cancel_one(step: int, results: dict[str, Completion]) -> None:
        if step == 4:
            before = served.scheduler.load()
            assert before.state_slots_used == 3, before
            seen_at_abort["r1"] = len(results["r1"].tokens)
            served.scheduler.abort("r1")
            after = served.scheduler.load()
            assert before.kv_pages_used - after.kv_pages_used >= 3, (before, after)
            assert after.state_slots_used == 2, after

    results = drive(served, requests, after_step=cancel_one)
    assert seen_at_abort, "the abort never happened"
    assert len(results["r1"].tokens) == seen_at_abort["r1"], "tokens arrived after the abort"
    assert results["r1"].terminal is None, "an aborted request must retire silently"
    for rid in ("r0", "r2"):
        assert results[rid].terminal == Finished(
            FinishReason.LENGTH, len(requests[int(rid[1])].prompt_token_ids), 32
        )
    load = served.scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used, load.state_slots_used) == (0, 0, 0, 0), load


def test_state_slots_never_leak(checkpoint_path: Path, qwen35_config: Qwen35Config) -> None:
    """256 requests of mixed sizes through 8 slots and a 9-page KV pool (so requests wait and are
    preempted, and slots are reused), 50 of them aborted at scattered steps: afterwards nothing is
    held, and every request that was not aborted finished with all its tokens."""
    served = load_for_gate(checkpoint_path, max_num_seqs=8, num_kv_pages=10, max_num_batched_tokens=64)
    scheduler = batch_scheduler(served)
    total = 256
    requests = [
        Request(
            f"q{i}",
            random_prompt(3 + (i * 37) % 29, seed=1000 + i, vocab_size=qwen35_config.vocab_size),
            greedy(1 + i % 8, logprobs=None),
        )
        for i in range(total)
    ]
    arrivals = {step: requests[32 + 8 * step : 40 + 8 * step] for step in range((total - 32) // 8)}
    aborted = {f"q{i}" for i in range(3, total, 5)}
    aborted = set(sorted(aborted)[:50])
    peak_in_flight: list[int] = [0]

    def churn(step: int, results: dict[str, Completion]) -> None:
        load = scheduler.load()
        assert load.state_slots_used <= 8 and load.state_slots_used == load.running, load
        peak_in_flight[0] = max(peak_in_flight[0], load.running + load.waiting)
        for rid in sorted(aborted):
            if rid in results and results[rid].terminal is None and (int(rid[1:]) + step) % 7 == 0:
                scheduler.abort(rid)

    results = drive(served, requests[:32], arrivals=arrivals, after_step=churn)
    load = scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used, load.state_slots_used) == (0, 0, 0, 0), load
    assert peak_in_flight[0] > 8, f"at most {peak_in_flight[0]} requests at once: the gate tested no waiting"
    assert scheduler.num_preemptions > 0, "nothing was preempted: the gate tested no preemption"
    for request in requests:
        got = results[request.request_id]
        if request.request_id in aborted and got.terminal is None:
            continue
        assert got.terminal == Finished(
            FinishReason.LENGTH, len(request.prompt_token_ids), request.sampling.max_tokens
        ), (request.request_id, got.terminal)


def test_context_limit_is_refused_not_truncated(checkpoint_path: Path, qwen35_config: Qwen35Config) -> None:
    limit = 64
    served = load_for_gate(checkpoint_path, max_model_len=limit)
    assert served.max_model_len == limit
    fits = Request("fits", random_prompt(54, seed=80, vocab_size=qwen35_config.vocab_size), greedy(10))
    over = Request("over", random_prompt(55, seed=81, vocab_size=qwen35_config.vocab_size), greedy(10))
    huge = Request("huge", random_prompt(100, seed=82, vocab_size=qwen35_config.vocab_size), greedy(1))
    results = drive(served, [fits, over, huge])
    assert results["fits"].terminal == Finished(FinishReason.LENGTH, 54, 10)
    for rid in ("over", "huge"):
        terminal = results[rid].terminal
        assert isinstance(terminal, Rejected) and terminal.reason is RejectReason.CONTEXT_LENGTH, terminal
        assert results[rid].tokens == [] and results[rid].admission is None
    assert served.scheduler.load().state_slots_used == 0
