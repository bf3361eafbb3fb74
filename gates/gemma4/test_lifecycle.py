"""Lifecycle at the model level: completion, cancellation, capacity and the context limit."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Finished, FinishReason, Rejected, RejectReason, Request, SamplingParams
from gates.gemma4.conftest import agree, prompt, request
from gates.harness.serving import Completion, drive, greedy, load_for_gate
from gates.harness.tolerances import Tolerance
from kernels.kv_layout import PAGE_SIZE, pages_for
from models.gemma4.config import Gemma4Config


def _no_pages_left(served_load: object) -> None:
    load = served_load
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0), load  # type: ignore[attr-defined]
    assert all(g.pages_used == 0 for g in load.groups), load.groups  # type: ignore[attr-defined]


def test_lifecycle_completes(checkpoint_path: Path, gemma4_config: Gemma4Config) -> None:
    """Many requests of mixed lengths (inside and past the window), greedy and sampled, EOS honoured
    or not, arriving over time: each ends exactly once and no page of either group stays in use."""
    w = gemma4_config.sliding_window
    served = load_for_gate(checkpoint_path, max_num_seqs=6, max_num_batched_tokens=2 * w)
    requests: list[Request] = []
    for i in range(16):
        sampling = (
            greedy(3 + i % 7)
            if i % 2
            else SamplingParams(max_tokens=4 + i, temperature=0.9, top_p=0.9, seed=i, ignore_eos=False)
        )
        requests.append(
            Request(f"r{i}", prompt(gemma4_config, 1 + (i * 7) % (4 * w), seed=200 + i), sampling)
        )
    arrivals = {3 * k: requests[4 * k : 4 * k + 4] for k in range(1, 4)}
    results = drive(served, requests[:4], arrivals=arrivals)
    for r in requests:
        got = results[r.request_id]
        assert got.terminals_seen == 1, f"{r.request_id}: {got.terminals_seen} terminals"
        assert isinstance(got.terminal, Finished), f"{r.request_id}: {got.terminal}"
        assert len(got.tokens) == got.terminal.completion_tokens <= r.sampling.max_tokens
    _no_pages_left(served.scheduler.load())


def test_cancel_frees_pages_and_stops_tokens(checkpoint_path: Path, gemma4_config: Gemma4Config) -> None:
    w = gemma4_config.sliding_window
    served = load_for_gate(checkpoint_path)
    requests = [request(gemma4_config, f"r{i}", 2 * w + 9 * i, seed=70 + i, new_tokens=32) for i in range(3)]
    seen_at_abort: dict[str, int] = {}

    def cancel_one(step: int, results: dict[str, Completion]) -> None:
        if step == 4:
            before = {g.name: g.pages_used for g in served.scheduler.load().groups}
            seen_at_abort["r1"] = len(results["r1"].tokens)
            served.scheduler.abort("r1")
            after = {g.name: g.pages_used for g in served.scheduler.load().groups}
            for name in before:
                assert after[name] < before[name], f"aborting r1 freed no {name} page: {before} -> {after}"

    results = drive(served, requests, after_step=cancel_one)
    assert seen_at_abort, "the abort never happened"
    assert len(results["r1"].tokens) == seen_at_abort["r1"], "tokens arrived after the abort"
    assert results["r1"].terminal is None, "an aborted request must retire silently"
    for i in (0, 2):
        assert results[f"r{i}"].terminal == Finished(
            FinishReason.LENGTH, len(requests[i].prompt_token_ids), 32
        )
    _no_pages_left(served.scheduler.load())


def test_slots_hold_at_capacity_edge(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tol: Tolerance
) -> None:
    """A pool of exactly P pages per group: a request spanning exactly P global pages is served (and
    computes what it computes with room to spare), one position more is refused as kv_budget, and a
    second request that does not fit beside the first waits for it instead of failing."""
    page = PAGE_SIZE
    pages = max(4, pages_for(3 * gemma4_config.sliding_window))
    new_tokens = 8
    # prompt + new_tokens - 1 positions are written: exactly `pages` full pages.
    exact = request(gemma4_config, "exact", pages * page - new_tokens + 1, seed=301, new_tokens=new_tokens)
    over = request(gemma4_config, "over", pages * page - new_tokens + 2, seed=302, new_tokens=new_tokens)
    after = request(gemma4_config, "after", page + 3, seed=303, new_tokens=new_tokens)
    edge = load_for_gate(checkpoint_path, num_kv_pages=pages + 1)
    roomy = drive(load_for_gate(checkpoint_path), [exact, after])
    results = drive(edge, [exact, over, after])
    terminal = results["over"].terminal
    assert isinstance(terminal, Rejected) and terminal.reason is RejectReason.KV_BUDGET, terminal
    for rid in ("exact", "after"):
        assert isinstance(results[rid].terminal, Finished), f"{rid}: {results[rid].terminal}"
        agree(f"{rid} at the edge vs with room", results[rid], roomy[rid], tol, new_tokens)
    _no_pages_left(edge.scheduler.load())


def test_context_limit_is_refused_not_truncated(checkpoint_path: Path, gemma4_config: Gemma4Config) -> None:
    limit = max(64, 2 * gemma4_config.sliding_window)
    served = load_for_gate(checkpoint_path, max_model_len=limit)
    assert served.max_model_len == limit
    fits = request(gemma4_config, "fits", limit - 10, seed=80, new_tokens=10)
    over = request(gemma4_config, "over", limit - 9, seed=81, new_tokens=10)
    huge = request(gemma4_config, "huge", limit + 36, seed=82, new_tokens=1)
    results = drive(served, [fits, over, huge])
    assert results["fits"].terminal == Finished(FinishReason.LENGTH, limit - 10, 10)
    for rid in ("over", "huge"):
        terminal = results[rid].terminal
        assert isinstance(terminal, Rejected) and terminal.reason is RejectReason.CONTEXT_LENGTH, terminal
        assert results[rid].tokens == [] and results[rid].admission is None
