"""Lifecycle gates any paged suite can run: an abort frees what the request held and stops its
tokens, and a request past the context limit is refused rather than truncated."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.contract import Finished, FinishReason, Load, Rejected, RejectReason, Request
from gates.harness.serving import Completion, drive, greedy, load_for_gate, random_prompt
from models.registry import LoadedModel

# Loads just before and just after the abort: a suite adds what its model holds beside pages.
AbortCheck = Callable[[Load, Load], None]


def check_cancel_frees_and_stops_tokens(
    checkpoint_path: Path, vocab_size: int, at_abort: AbortCheck | None = None
) -> LoadedModel:
    """Three 32-token requests; the middle one (49 prompt tokens) is aborted at step 4. Returns the
    drained model for the suite's own final checks."""
    served = load_for_gate(checkpoint_path)
    requests = [
        Request(f"r{i}", random_prompt(40 + 9 * i, seed=70 + i, vocab_size=vocab_size), greedy(32))
        for i in range(3)
    ]
    seen_at_abort: dict[str, int] = {}

    def cancel_one(step: int, results: dict[str, Completion]) -> None:
        if step == 4:
            before = served.scheduler.load()
            seen_at_abort["r1"] = len(results["r1"].tokens)
            served.scheduler.abort("r1")
            after = served.scheduler.load()
            freed = before.kv_pages_used - after.kv_pages_used
            assert freed >= 3, f"aborting a 49-token request freed {freed} pages ({before}, {after})"
            if at_abort is not None:
                at_abort(before, after)

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
    return served


def check_context_limit_is_refused(checkpoint_path: Path, vocab_size: int) -> LoadedModel:
    """At a 64-token limit, 54 + 10 tokens finish; 55 + 10 and a 100-token prompt are refused
    outright. Returns the model for the suite's own final checks."""
    limit = 64
    served = load_for_gate(checkpoint_path, max_model_len=limit)
    assert served.max_model_len == limit
    fits = Request("fits", random_prompt(54, seed=80, vocab_size=vocab_size), greedy(10))
    over = Request("over", random_prompt(55, seed=81, vocab_size=vocab_size), greedy(10))
    huge = Request("huge", random_prompt(100, seed=82, vocab_size=vocab_size), greedy(1))
    results = drive(served, [fits, over, huge])
    assert results["fits"].terminal == Finished(FinishReason.LENGTH, 54, 10)
    for rid in ("over", "huge"):
        terminal = results[rid].terminal
        assert isinstance(terminal, Rejected) and terminal.reason is RejectReason.CONTEXT_LENGTH, terminal
        assert results[rid].tokens == [] and results[rid].admission is None
    return served
