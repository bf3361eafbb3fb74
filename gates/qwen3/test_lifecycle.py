"""Lifecycle at the model level: cancellation and the context limit."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Finished, FinishReason, Rejected, RejectReason, Request
from gates.harness.serving import Completion, drive, greedy, load_for_gate, random_prompt
from models.qwen3.config import Qwen3Config


def test_cancel_frees_pages_and_stops_tokens(checkpoint_path: Path, qwen3_config: Qwen3Config) -> None:
    served = load_for_gate(checkpoint_path)
    requests = [
        Request(
            f"r{i}", random_prompt(40 + 9 * i, seed=70 + i, vocab_size=qwen3_config.vocab_size), greedy(32)
        )
        for i in range(3)
    ]
    seen_at_abort: dict[str, int] = {}
    pages_before: list[int] = []

    def cancel_one(step: int, results: dict[str, Completion]) -> None:
        if step == 4:
            pages_before.append(served.scheduler.load().kv_pages_used)
            seen_at_abort["r1"] = len(results["r1"].tokens)
            served.scheduler.abort("r1")
            freed = pages_before[0] - served.scheduler.load().kv_pages_used
            assert freed >= 3, f"aborting a 49-token request freed {freed} pages"

    results = drive(served, requests, after_step=cancel_one)
    assert seen_at_abort, "the abort never happened"
    assert len(results["r1"].tokens) == seen_at_abort["r1"], "tokens arrived after the abort"
    assert results["r1"].terminal is None, "an aborted request must retire silently"
    for rid in ("r0", "r2"):
        assert results[rid].terminal == Finished(
            FinishReason.LENGTH, len(requests[int(rid[1])].prompt_token_ids), 32
        )
    load = served.scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0), load


def test_context_limit_is_refused_not_truncated(checkpoint_path: Path, qwen3_config: Qwen3Config) -> None:
    limit = 64
    served = load_for_gate(checkpoint_path, max_model_len=limit)
    assert served.max_model_len == limit
    fits = Request("fits", random_prompt(54, seed=80, vocab_size=qwen3_config.vocab_size), greedy(10))
    over = Request("over", random_prompt(55, seed=81, vocab_size=qwen3_config.vocab_size), greedy(10))
    huge = Request("huge", random_prompt(100, seed=82, vocab_size=qwen3_config.vocab_size), greedy(1))
    results = drive(served, [fits, over, huge])
    assert results["fits"].terminal == Finished(FinishReason.LENGTH, 54, 10)
    for rid in ("over", "huge"):
        terminal = results[rid].terminal
        assert isinstance(terminal, Rejected) and terminal.reason is RejectReason.CONTEXT_LENGTH, terminal
        assert results[rid].tokens == [] and results[rid].admission is None
