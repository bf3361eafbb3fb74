"""Lifecycle at the model level: cancellation frees pages and the state slot, slots never leak,
and the context limit refuses rather than truncates."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Finished, FinishReason, Load, Request
from gates.harness.lifecycle import check_cancel_frees_and_stops_tokens, check_context_limit_is_refused
from gates.harness.serving import Completion, batch_scheduler, drive, greedy, load_for_gate, random_prompt
from models.qwen35.config import Qwen35Config


def test_cancel_frees_pages_and_slots(checkpoint_path: Path, qwen35_config: Qwen35Config) -> None:
    def slot_freed(before: Load, after: Load) -> None:
        assert before.state_slots_used == 3, before
        assert after.state_slots_used == 2, after

    served = check_cancel_frees_and_stops_tokens(
        checkpoint_path, qwen35_config.vocab_size, at_abort=slot_freed
    )
    assert served.scheduler.load().state_slots_used == 0, served.scheduler.load()


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
    served = check_context_limit_is_refused(checkpoint_path, qwen35_config.vocab_size)
    assert served.scheduler.load().state_slots_used == 0
