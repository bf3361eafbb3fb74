"""Async scheduling for a model with recurrent state: state slots follow the pages' rules, and a
launched step makes its state restores before its forward and its snapshots after it.

Over the sim, `StateSim` (test_state_snapshots.py) checks every row's slot holds exactly the tokens
before its first position, so a restore from a wrong or overwritten snapshot, a snapshot taken at
the wrong position or a copy run out of order fails the step; `LateDevice` (test_async_scheduling.py)
runs each launched step only when it is collected, and checks that every row's pages and state slot
are still held, and every snapshot slot it writes still pending, when it finally runs. The tiny
Qwen3.5 line runs `PagedModelRunner.launch_step` against its own synchronous run.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_async_scheduling import LateDevice, _compare_real_line, run_staggered
from test_batch_scheduler import Outcome, prompts
from test_state_snapshots import StateSim, assert_consistent, tokens
from test_state_snapshots import make as make_state_scheduler

from engine.contract import Failed, Request, SamplingParams
from engine.runner import BatchRow, StepBatch, StepHandle
from engine.scheduler import BatchScheduler, _DrainFirst
from models.sim import sim_completion


def make(
    *, async_scheduling: bool, snapshots: int = 16, pages: int = 4096, budget: int = 64, seqs: int = 8
) -> tuple[BatchScheduler, StateSim]:
    """test_state_snapshots' scheduler over the state sim; under async scheduling the sim runs
    behind a `LateDevice`."""
    scheduler, sim = make_state_scheduler(
        snapshots,
        pages,
        budget,
        seqs,
        async_scheduling=async_scheduling,
        device=LateDevice if async_scheduling else None,
    )
    if isinstance(scheduler.runner, LateDevice):
        scheduler.runner.scheduler = scheduler
    return scheduler, sim


def assert_all_returned(scheduler: BatchScheduler) -> None:
    load = scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used, load.state_slots_used) == (0, 0, 0, 0), load
    assert not scheduler.has_work()
    assert_consistent(scheduler)


def shared_prefix_requests(n: int, seed: int) -> list[Request]:
    """Prompts that share the first 0-70 tokens of two bases (hits at several page depths), with
    greedy and seeded sampling, EOS stops and length finishes."""
    rng = random.Random(seed)
    bases = [tokens(70, seed=seed * 10 + 1), tokens(45, seed=seed * 10 + 2)]
    out = []
    for i in range(n):
        base = bases[rng.randrange(2)]
        depth = rng.choice([0, 16, 20, 32, 40, 48, 64, 70])
        prompt = base[:depth] + tokens(rng.randrange(1 if depth else 3, 24), seed=seed * 1000 + i)
        params = SamplingParams(
            max_tokens=rng.choice([1, 3, 8, 20]),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            ignore_eos=rng.random() < 0.3,
            logprobs=1,
        )
        out.append(Request(f"s{i}", prompt, params))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_async_gives_the_sync_tokens_with_prefix_hits_aborts_and_preemption(seed: int) -> None:
    rng = random.Random(seed)
    reqs = shared_prefix_requests(28, seed)
    arrivals = sorted(rng.randrange(0, 30) for _ in reqs)
    aborts: dict[int, list[str]] = {}
    for r in rng.sample(reqs, 4):
        aborts.setdefault(rng.randrange(0, 40), []).append(r.request_id)
    aborted = {rid for rids in aborts.values() for rid in rids}
    # 11 usable pages for 6 requests of up to ~110 tokens: preemption is frequent.
    settings = {"snapshots": 6, "pages": 12, "budget": rng.choice([16, 33, 64]), "seqs": 6}
    outcomes: dict[bool, Outcome] = {}
    for mode in (False, True):
        scheduler, _ = make(async_scheduling=mode, **settings)
        outcomes[mode] = run_staggered(scheduler, reqs, arrivals=arrivals, aborts=aborts)
        assert_all_returned(scheduler)
        assert scheduler.num_preemptions > 0
        assert any(outcomes[mode].cached.values()), "no prefix hit"
        if mode:
            stats = scheduler.async_stats
            assert stats.launches == stats.collects and stats.fed_rows > 0
            assert stats.drains > 0 and stats.deferred_frees > 0
    sync, async_ = outcomes[False], outcomes[True]
    for r in reqs:
        expected = list(sim_completion(r.prompt_token_ids, r.sampling).token_ids)
        for outcome in (sync, async_):
            got = outcome.tokens.get(r.request_id, [])
            if r.request_id in aborted and r.request_id not in outcome.terminals:
                assert got == expected[: len(got)], r.request_id
            else:
                assert not isinstance(outcome.terminals[r.request_id], Failed)
                assert got == expected, r.request_id
        if r.request_id not in aborted:
            assert async_.tokens[r.request_id] == sync.tokens[r.request_id]
            assert async_.logprobs.get(r.request_id) == sync.logprobs.get(r.request_id)
            assert async_.terminals[r.request_id] == sync.terminals[r.request_id]


def test_a_snapshot_restored_by_a_launched_step_may_be_retaken_before_that_step_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One snapshot slot: a resend's restore from it is launched, and before that step runs on the
    late device the next step hands the same slot to a new prompt's snapshot (LRU eviction). The
    restore is queued first, so it still reads the old state; the resend matches a cold run."""
    scheduler, sim = make(async_scheduling=True, snapshots=1)
    runner = scheduler.runner
    assert isinstance(runner, LateDevice)
    snapshots = scheduler.kv.snapshots
    assert snapshots is not None
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = tokens(40, seed=1)
    run_staggered(scheduler, [Request("a", first, greedy)], arrivals=[0])
    (slot,) = [snapshots.find(h) for h in snapshots.hashes()]
    assert slot is not None

    retaken_while_queued = 0
    launch = runner.launch_step

    def watching_launch(batch: StepBatch, feed: StepHandle | None) -> StepHandle:
        nonlocal retaken_while_queued
        for handle in runner.queue:  # launched earlier, not yet run
            for src, _ in handle.batch.restore_state:
                if src in snapshots._pending:  # handed to a snapshot this launch writes
                    retaken_while_queued += 1
        return launch(batch, feed)

    monkeypatch.setattr(runner, "launch_step", watching_launch)

    # The resend restores from the slot at 32; a new 40-token prompt arriving a step later ends its
    # first chunk at 32 and takes the only slot, evicting the snapshot the resend reads.
    resend, other = Request("resend", first, greedy), Request("new", tokens(40, seed=2), greedy)
    outcome = run_staggered(scheduler, [resend, other], arrivals=[0, 1])
    assert outcome.cached["resend"] == 32 and snapshots.evicted_for_space == 1
    assert retaken_while_queued > 0
    for r in (resend, other):
        assert outcome.tokens[r.request_id] == list(sim_completion(r.prompt_token_ids, r.sampling).token_ids)
    assert sim.chunks["resend"][0] == (32, 40)
    assert_all_returned(scheduler)


def test_a_drain_gives_back_the_snapshots_its_discarded_rows_took(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose prefill chunk took a snapshot, then had to preempt with a step in flight: it
    collects that step and schedules again, and the snapshot of the discarded row is given back
    (a leak would leave it pending forever). The tokens are the sim's."""
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 6, 24)]
    reqs = [
        Request(f"d{i}", tokens(n, seed=16320 + i), params)
        for i, (n, params) in enumerate(zip((96, 19, 71), greedy, strict=True))
    ]
    scheduler, _ = make(async_scheduling=True, snapshots=4, pages=10, budget=64, seqs=3)
    discarded: list[int] = []
    schedule = scheduler._schedule

    def watching_schedule() -> list[BatchRow]:
        try:
            return schedule()
        except _DrainFirst:
            discarded.append(len(scheduler._snapshot_copies))
            raise

    monkeypatch.setattr(scheduler, "_schedule", watching_schedule)
    outcome = run_staggered(scheduler, reqs, arrivals=[2, 2, 3])
    assert sum(discarded) > 0, discarded
    for r in reqs:
        assert outcome.tokens[r.request_id] == list(sim_completion(r.prompt_token_ids, r.sampling).token_ids)
    assert_all_returned(scheduler)


def test_an_abort_frees_slot_and_pages_at_once_and_its_snapshot_when_the_step_is_collected() -> None:
    """The launched step writes a snapshot from the request's slot: the abort waits for it on the
    device (the fake device checks, as the step runs, that the slot and pages are still held), then
    frees them; the snapshot slot is the launch's, released when the step is collected."""
    scheduler, _ = make(async_scheduling=True)
    snapshots = scheduler.kv.snapshots
    assert snapshots is not None
    scheduler.submit(Request("a", tokens(40, seed=3), SamplingParams(max_tokens=4, ignore_eos=True)))
    scheduler.step()  # launches the chunk [0, 32), which snapshots at 32
    assert (snapshots.pending, scheduler.load().state_slots_used) == (1, 1)
    scheduler.abort("a")
    load = scheduler.load()
    assert (snapshots.pending, load.state_slots_used, load.kv_pages_used) == (
        1,
        0,
        0,
    ) and scheduler.has_work()
    assert scheduler.step().updates == ()
    assert (snapshots.pending, snapshots.held) == (0, 0)
    assert scheduler.async_stats.deferred_frees == 0
    assert_all_returned(scheduler)


def test_a_failed_launch_gives_back_the_snapshots_of_both_steps() -> None:
    scheduler, _ = make(async_scheduling=True, budget=16)
    runner = scheduler.runner
    assert isinstance(runner, LateDevice)
    snapshots = scheduler.kv.snapshots
    assert snapshots is not None
    scheduler.submit(Request("a", tokens(70, seed=4), SamplingParams(max_tokens=4, ignore_eos=True)))
    scheduler.step()  # [0, 16): one snapshot, in flight
    runner.fail_launch = RuntimeError
    with pytest.raises(RuntimeError, match="injected"):
        scheduler.step()  # [16, 32) took another, then its launch failed
    assert snapshots.pending == 2
    scheduler.fail_step("boom")
    assert (snapshots.pending, snapshots.held) == (0, 0)
    assert_all_returned(scheduler)


# -- the tiny Qwen3.5 line on CPU --------------------------------------------------------------


def _qwen35_requests(eos_free: bool) -> list[Request]:
    """m0 stops on a token it samples; the others share prefixes of one base at 20, 40, 60 and 68
    tokens and arrive after the request that snapshots their depth has prefilled, so each hits at
    16, 32 or 48 (a page boundary with a snapshot) in the sync and async runs alike."""
    (base,) = prompts(1, 60, 60, seed=31)
    other = prompts(4, 5, 24, seed=32)
    specs = [
        # (prompt, max_tokens, temperature, top_p, seed)
        (base[:20], 16, 0.0, 1.0, None),
        (other[0], 12, 0.8, 1.0, 7),
        (base[:40] + other[1][:5], 24, 1.0, 0.9, 3),
        (base, 10, 0.0, 1.0, None),
        (base + other[2][:8], 12, 0.7, 0.95, 11),
        (base, 6, 0.0, 1.0, None),
        (base[:33] + other[3], 8, 0.9, 1.0, 5),
    ]
    return [
        Request(
            f"m{i}",
            prompt,
            SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                logprobs=2,
                ignore_eos=eos_free,
            ),
        )
        for i, (prompt, max_tokens, temperature, top_p, seed) in enumerate(specs)
    ]


def test_qwen35_tiny_async_gives_the_sync_tokens_logprobs_and_hits(tiny_qwen35: Path) -> None:
    outcome, scheduler = _compare_real_line(tiny_qwen35, _qwen35_requests, arrivals=(0, 0, 5, 10, 16, 22, 26))
    # Restores from snapshots at several depths ran in launched steps.
    assert {outcome.cached[f"m{i}"] for i in range(7)} >= {16, 32, 48}
    assert scheduler.async_stats.deferred_frees > 0
