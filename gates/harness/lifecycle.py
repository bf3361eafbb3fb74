"""Lifecycle gates any paged suite can run: an abort frees what the request held and stops its
tokens, and a request past the context limit is refused rather than truncated."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.contract import Finished, FinishReason, Load, Rejected, RejectReason, Request
from gates.harness.serving import Completion, batch_scheduler, drive, greedy, load_for_gate, random_prompt
from models.registry import LoadedModel

# Loads just before the abort and once the aborted request's pages are freed (at once; under async
# scheduling when the step in flight is collected): a suite adds what its model holds beside pages.
AbortCheck = Callable[[Load, Load], None]


def check_cancel_frees_and_stops_tokens(
    checkpoint_path: Path, vocab_size: int, at_abort: AbortCheck | None = None
) -> LoadedModel:
    """Three 32-token requests; the middle one (49 prompt tokens) is aborted at step 4. Its pages
    are freed at once, or, under async scheduling, when the step launched with its row is collected
    (the next step: docs/engine.md). Returns the drained model for the suite's own final checks."""
    served = load_for_gate(checkpoint_path)
    scheduler = batch_scheduler(served)
    requests = [
        Request(f"r{i}", random_prompt(40 + 9 * i, seed=70 + i, vocab_size=vocab_size), greedy(32))
        for i in range(3)
    ]
    seen_at_abort: dict[str, int] = {}
    deferred: list[Load] = []

    def cancel_one(step: int, results: dict[str, Completion]) -> None:
        if step == 4:
            before = scheduler.load()
            seen_at_abort["r1"] = len(results["r1"].tokens)
            held = sum(scheduler.kv.live_pages("r1"))
            assert held >= 3, f"a 49-token request holds {held} pages ({before})"
            scheduler.abort("r1")
            after = scheduler.load()
            if scheduler.config.async_scheduling and scheduler.kv.holds("r1"):
                # Its row in the launched step may still write its pages: freed at that collection.
                assert after.kv_pages_used == before.kv_pages_used, (before, after)
                deferred.append(before)
                return
            freed = before.kv_pages_used - after.kv_pages_used
            assert freed >= 3, f"aborting a 49-token request freed {freed} pages ({before}, {after})"
            if at_abort is not None:
                at_abort(before, after)
        elif step == 5 and deferred:
            after = scheduler.load()
            assert not scheduler.kv.holds("r1"), f"r1's pages outlived the step in flight ({after})"
            assert scheduler.async_stats.deferred_frees >= 1
            if at_abort is not None:
                at_abort(deferred[0], after)

    results = drive(served, requests, after_step=cancel_one)
    assert seen_at_abort, "the abort never happened"
    assert len(results["r1"].tokens) == seen_at_abort["r1"], "tokens arrived after the abort"
    assert results["r1"].terminal is None, "an aborted request must retire silently"
    for rid in ("r0", "r2"):
        assert results[rid].terminal == Finished(
            FinishReason.LENGTH, len(requests[int(rid[1])].prompt_token_ids), 32
        )
    if scheduler.config.async_scheduling:
        assert deferred, "under async scheduling the aborted request had no row in flight"
    load = scheduler.load()
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
