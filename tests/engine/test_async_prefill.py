"""Overlapped prefill (`EngineConfig.async_prefill`) in the generic BatchScheduler, over the sim.

`LateRunner` stands in for a device that runs a side-stream prefill late: `launch_prefill` only
records the batch, the sim computes it when the handle is collected, and `done()` turns true only
after `lag` decode steps. A prefill's KV is therefore written after every decode step that ran
beside it, so a page freed, released or handed to another request while the prefill was in flight
shows up as a wrong token or a `SimKVError`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_batch_scheduler import (  # the sibling module: pytest puts tests/engine on sys.path
    Outcome,
    SpyRunner,
    assert_idle_and_empty,
    assert_matches_sim,
    drive,
    prompts,
    requests_for,
)
from typer.testing import CliRunner

from engine.config import EngineConfig
from engine.contract import Failed, Request
from engine.kv import KVGroupSpec
from engine.runner import PrefillHandle, SampledToken, StepBatch
from engine.scheduler import BatchScheduler
from infer_cli import serve_cmd
from infer_cli.main import app
from models.registry import LoadedModel, ModelLoadError, ModelOptions, load_model
from models.sim import EOS_TOKEN_ID, VOCAB_SIZE, SimOptions, SimRunner


class _LateHandle:
    def __init__(self, runner: LateRunner, batch: StepBatch) -> None:
        self._runner = runner
        self.batch = batch
        self.decodes_at_launch = runner.decode_steps
        self.collected = False

    def done(self) -> bool:
        return self._runner.decode_steps - self.decodes_at_launch >= self._runner.lag

    def collect(self) -> list[SampledToken | None]:
        assert not self.collected, "a prefill handle was collected twice"
        self.collected = True
        self._runner.in_flight.remove(self)
        return self._runner.inner.execute(self.batch)


class LateRunner:
    """Implements `engine.runner.OverlappingRunner` over the sim, computing prefills at collect."""

    def __init__(self, inner: SimRunner, lag: int) -> None:
        self.inner = inner
        self.lag = lag
        self.decode_steps = 0
        self.launches: list[StepBatch] = []
        self.in_flight: list[_LateHandle] = []
        # Called with each decode batch before it runs; raising fails the step.
        self.fault: type[Exception] | None = None

    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        assert all(len(r.token_ids) == 1 and r.sample for r in batch.rows), "a prefill row on the main stream"
        if self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault("injected")
        self.decode_steps += 1
        return self.inner.execute(batch)

    def launch_prefill(self, batch: StepBatch) -> PrefillHandle:
        assert not self.in_flight, "a second side prefill launched while one is in flight"
        handle = _LateHandle(self, batch)
        self.launches.append(batch)
        self.in_flight.append(handle)
        return handle


def make_async(
    *,
    lag: int = 1,
    num_pages: int = 4096,
    budget: int = 2048,
    max_num_seqs: int = 256,
    sliding: int | None = None,
    prefix: bool = True,
) -> tuple[BatchScheduler, LateRunner, tuple[KVGroupSpec, ...]]:
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix,
        async_prefill=True,
    )
    groups = SimOptions(engine=config, num_kv_pages=num_pages, sliding_window=sliding).kv_groups()
    runner = LateRunner(SimRunner(groups), lag)
    scheduler = BatchScheduler(
        runner, config, groups, {EOS_TOKEN_ID}, 4096, model_id="sim", vocab_size=VOCAB_SIZE
    )
    return scheduler, runner, groups


def step(scheduler: BatchScheduler, outcome: Outcome) -> None:
    outcome.absorb(scheduler.step().updates)
    outcome.steps += 1


# -- the same tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lag", "budget", "sliding", "prefix"),
    [(0, 2048, None, True), (1, 33, None, True), (3, 16, 24, False), (2, 7, 40, False), (5, 64, None, False)],
)
def test_overlapped_prefill_gives_the_sims_tokens(
    lag: int, budget: int, sliding: int | None, prefix: bool
) -> None:
    reqs = requests_for(prompts(10, 20, 90, seed=lag + budget), max_tokens=20, ignore_eos=True, logprobs=1)
    # A shared prefix, so prefix hits happen between overlapped prefills too.
    reqs += requests_for([(*reqs[0].prompt_token_ids, 40, 41)], max_tokens=8, prefix="shared")
    scheduler, runner, _ = make_async(lag=lag, budget=budget, sliding=sliding, prefix=prefix)
    outcome = Outcome()
    for i, request in enumerate(reqs):  # staggered arrivals: prefills launch beside decodes
        scheduler.submit(request)
        for _ in range(i % 3):
            step(scheduler, outcome)
    drive(scheduler, outcome=outcome)
    assert_matches_sim(outcome, reqs)
    assert_idle_and_empty(scheduler)
    stats = scheduler.prefill_overlap
    assert stats.launches == stats.joins == len(runner.launches) > 0
    assert stats.overlapped_decode_steps > 0
    assert all(len(r.token_ids) <= budget for b in runner.launches for r in b.rows)
    if budget < 90:
        assert any(not r.sample for b in runner.launches for r in b.rows), "no prompt was prefilled in chunks"


def test_a_runner_without_a_second_stream_prefills_at_launch_and_joins_later() -> None:
    config = EngineConfig(async_prefill=True)
    groups = SimOptions(engine=config).kv_groups()
    spy = SpyRunner(SimRunner(groups))
    scheduler = BatchScheduler(
        spy, config, groups, {EOS_TOKEN_ID}, 4096, model_id="sim", vocab_size=VOCAB_SIZE
    )
    reqs = requests_for(prompts(6, 10, 40, seed=5), max_tokens=12)
    outcome = drive(scheduler, reqs)
    assert_matches_sim(outcome, reqs)
    assert_idle_and_empty(scheduler)
    assert scheduler.prefill_overlap.launches == scheduler.prefill_overlap.joins >= 1
    assert scheduler.prefill_overlap.still_running_after_decode == 0


# -- when the join happens ------------------------------------------------------------------------


def test_the_join_happens_at_a_later_step_and_load_counts_the_prefill() -> None:
    scheduler, _runner, _ = make_async(lag=0, prefix=False)
    (request,) = requests_for(prompts(1, 40, 40, seed=1), max_tokens=5, ignore_eos=True)
    scheduler.submit(request)
    outcome = Outcome()
    step(scheduler, outcome)
    # Launched (a forward that is already done counts as in flight until a later step joins it).
    assert outcome.admissions["r0"] == 1 and outcome.tokens.get("r0", []) == []
    assert scheduler.prefill_in_flight() == ("r0",)
    load = scheduler.load()
    assert (load.running, load.waiting) == (1, 0)
    assert load.kv_pages_used == 3 == sum(scheduler.kv.live_pages("r0"))
    assert scheduler.has_work()
    step(scheduler, outcome)
    # Joined: the first token, and the request decodes in the same step.
    assert scheduler.prefill_in_flight() == ()
    assert len(outcome.tokens["r0"]) == 2
    drive(scheduler, outcome=outcome)
    assert_matches_sim(outcome, [request])
    assert_idle_and_empty(scheduler)


def test_decodes_advance_while_a_prefill_is_in_flight() -> None:
    scheduler, _runner, _ = make_async(lag=3, prefix=False)
    first, second = requests_for(prompts(2, 30, 60, seed=2), max_tokens=30, ignore_eos=True)
    outcome = Outcome()
    scheduler.submit(first)
    while len(outcome.tokens.get("r0", [])) < 2:
        step(scheduler, outcome)
    scheduler.submit(second)
    advanced_beside: list[int] = []
    while not outcome.tokens.get("r1"):
        before = len(outcome.tokens["r0"])
        step(scheduler, outcome)
        if scheduler.prefill_in_flight() == ("r1",):
            assert scheduler.load().running == 2
            advanced_beside.append(len(outcome.tokens["r0"]) - before)
    # Launched in one step, in flight for the 3 decode steps the lag asks for, joined after them.
    assert advanced_beside == [1, 1, 1], advanced_beside
    assert scheduler.prefill_overlap.overlapped_decode_steps >= 3
    drive(scheduler, outcome=outcome)
    assert_matches_sim(outcome, [first, second])
    assert_idle_and_empty(scheduler)


def test_with_nothing_to_decode_the_scheduler_waits_for_the_prefill_instead_of_spinning() -> None:
    scheduler, _runner, _ = make_async(lag=1000)
    reqs = requests_for(prompts(2, 20, 20, seed=3), max_tokens=3)
    outcome = drive(scheduler, reqs, max_steps=50)
    assert_matches_sim(outcome, reqs)
    assert scheduler.prefill_overlap.joins == 1


# -- pages of an in-flight prefill -----------------------------------------------------------------


def test_abort_in_flight_defers_freeing_pages_until_the_join() -> None:
    # Room for the decoding request and exactly one more prompt: the waiting one fits only once
    # the aborted prefill's pages are back.
    scheduler, _runner, _ = make_async(lag=4, num_pages=1 + 4 + 3, prefix=False)
    decoding, doomed, waiting = requests_for(prompts(3, 48, 48, seed=4), max_tokens=12, ignore_eos=True)
    outcome = Outcome()
    scheduler.submit(decoding)
    while not outcome.tokens.get("r0"):
        step(scheduler, outcome)
    assert sum(scheduler.kv.live_pages("r0")) == 4
    scheduler.submit(doomed)
    step(scheduler, outcome)
    assert scheduler.prefill_in_flight() == ("r1",)
    used = scheduler.load().kv_pages_used
    held = sum(scheduler.kv.live_pages("r1"))
    assert held == 3
    scheduler.abort("r1")
    scheduler.submit(waiting)
    # Retired at once (not running, nothing more emitted), but its pages stay until the join.
    assert scheduler.load().running == 1
    assert scheduler.load().kv_pages_used == used
    assert scheduler.prefill_in_flight() == ("r1",)
    while "r1" in scheduler.prefill_in_flight():
        step(scheduler, outcome)
        if "r1" in scheduler.prefill_in_flight():
            assert outcome.admissions["r2"] == 0, "the waiting request got pages an in-flight prefill holds"
            assert scheduler.load().kv_pages_used == used
    # The step that joined the aborted prefill freed its pages, and the waiting request took them.
    assert outcome.admissions["r2"] == 1
    assert scheduler.prefill_overlap.deferred_frees == 1
    assert not scheduler.kv.holds("r1")
    drive(scheduler, outcome=outcome)
    assert "r1" not in outcome.terminals and outcome.tokens.get("r1", []) == []
    assert_matches_sim(outcome, [decoding, waiting])
    assert_idle_and_empty(scheduler)


def test_abort_of_every_request_in_flight_still_frees_everything() -> None:
    scheduler, _runner, _ = make_async(lag=1000)
    reqs = requests_for(prompts(3, 30, 50, seed=6), max_tokens=4)
    outcome = Outcome()
    for r in reqs:
        scheduler.submit(r)
    step(scheduler, outcome)
    assert set(scheduler.prefill_in_flight()) == {"r0", "r1", "r2"}
    for r in reqs:
        scheduler.abort(r.request_id)
    assert scheduler.load().running == 0 and scheduler.load().kv_pages_used > 0
    assert scheduler.has_work()  # the join is still owed
    drive(scheduler, outcome=outcome, max_steps=5)
    assert outcome.terminals == {}
    assert scheduler.prefill_overlap.deferred_frees == 3
    assert_idle_and_empty(scheduler)


def test_a_failed_decode_step_fails_the_prefills_it_launched_and_frees_their_pages_after_the_join() -> None:
    scheduler, runner, _ = make_async(lag=2, prefix=False)
    first, second, third = requests_for(prompts(3, 20, 40, seed=7), max_tokens=10, ignore_eos=True)
    outcome = Outcome()
    scheduler.submit(first)
    while len(outcome.tokens.get("r0", [])) < 2:
        step(scheduler, outcome)
    scheduler.submit(second)
    runner.fault = RuntimeError
    with pytest.raises(RuntimeError):
        scheduler.step()
    outcome.absorb(scheduler.fail_step("step failed: injected").updates)
    # Both had a row in the step that raised; the prefill's pages wait for its join.
    assert outcome.terminals["r0"] == Failed("step failed: injected")
    assert outcome.terminals["r1"] == Failed("step failed: injected")
    assert scheduler.kv.holds("r1") and not scheduler.kv.holds("r0")
    scheduler.submit(third)
    drive(scheduler, outcome=outcome)
    assert scheduler.prefill_overlap.deferred_frees == 1
    assert_matches_sim(outcome, [third])
    assert_idle_and_empty(scheduler)


@pytest.mark.parametrize("seed", range(6))
def test_randomized_pressure_aborts_and_windows(seed: int) -> None:
    """Tight pages (preemption), sliding windows, chunked prefills, random lags and aborts: every
    request that is not aborted gets the sim's tokens, each gets at most one terminal, and nothing
    is left held. The late runner turns any page misuse around an in-flight prefill into a wrong
    token."""
    rng = random.Random(seed)
    scheduler, runner, _ = make_async(
        lag=rng.randint(0, 4),
        num_pages=rng.randint(14, 40),
        budget=rng.choice([8, 17, 40, 256]),
        max_num_seqs=rng.randint(2, 8),
        sliding=rng.choice([None, 20, 33]),
        prefix=False,
    )
    reqs = requests_for(prompts(14, 5, 70, seed=seed), max_tokens=rng.randint(4, 30), ignore_eos=True)
    outcome = Outcome()
    aborted: set[str] = set()
    pending = list(reqs)
    while pending or scheduler.has_work():
        for _ in range(rng.randint(0, 2)):
            if pending:
                scheduler.submit(pending.pop(0))
        if rng.random() < 0.08:
            live = [r.request_id for r in reqs if r.request_id not in outcome.terminals]
            victim = rng.choice(live)
            aborted.add(victim)
            scheduler.abort(victim)
        if scheduler.has_work():
            step(scheduler, outcome)
        assert outcome.steps < 20_000
    for rid in aborted:
        assert rid not in outcome.terminals or outcome.terminals[rid] is not None
    served = [r for r in reqs if r.request_id not in aborted]
    assert_matches_sim(outcome, served)
    assert_idle_and_empty(scheduler)
    assert runner.in_flight == []


# -- the flag --------------------------------------------------------------------------------------


def test_async_prefill_is_off_by_default_and_the_serve_flag_turns_it_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert EngineConfig().async_prefill is False
    seen: list[EngineConfig] = []

    def fake_load(spec: str, options: ModelOptions) -> LoadedModel:
        seen.append(options.engine)
        raise ModelLoadError("stopped by the test after the options were built")

    monkeypatch.setattr(serve_cmd, "load_model", fake_load)
    for args, expected in (([], False), (["--async-prefill"], True)):
        result = CliRunner().invoke(app, ["serve", "--model", "x", *args])
        assert seen[-1].async_prefill is expected, result.output


def test_sync_mode_never_launches_a_side_prefill() -> None:
    config = EngineConfig()
    groups = SimOptions(engine=config).kv_groups()
    runner = LateRunner(SimRunner(groups), lag=0)
    runner_execute = runner.inner.execute
    runner.execute = runner_execute  # type: ignore[method-assign]  # sync steps mix prefill rows
    scheduler = BatchScheduler(
        runner, config, groups, {EOS_TOKEN_ID}, 4096, model_id="sim", vocab_size=VOCAB_SIZE
    )
    reqs = requests_for(prompts(3, 10, 30, seed=8), max_tokens=5)
    outcome = drive(scheduler, reqs)
    assert_matches_sim(outcome, reqs)
    assert runner.launches == [] and scheduler.prefill_overlap.launches == 0


def test_requests_admitted_together_share_one_side_forward() -> None:
    scheduler, runner, _ = make_async(lag=1)
    reqs = requests_for(prompts(4, 10, 20, seed=9), max_tokens=4)
    for r in reqs:
        scheduler.submit(r)
    scheduler.step()
    assert [len(b.rows) for b in runner.launches] == [4]
    assert isinstance(reqs[0], Request)


# -- a real paged model on CPU ---------------------------------------------------------------------


def test_qwen3_tiny_gives_the_same_greedy_stream_with_async_prefill(tiny_qwen3: Path) -> None:
    """The PagedModelRunner's launch path (a sibling attention backend; on CPU the forward runs at
    launch) over the qwen3 line: the sync run's tokens, log-probs within fp32 noise."""

    def run(async_prefill: bool) -> tuple[Outcome, BatchScheduler]:
        engine = EngineConfig(max_num_batched_tokens=16, num_kv_pages=64, async_prefill=async_prefill)
        loaded = load_model(str(tiny_qwen3), ModelOptions(engine=engine, device="cpu"))
        assert isinstance(loaded.scheduler, BatchScheduler)
        scheduler = loaded.scheduler
        reqs = requests_for(
            prompts(4, 5, 40, seed=11), max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2
        )
        outcome = Outcome()
        for i, r in enumerate(reqs):
            scheduler.submit(r)
            for _ in range(i):
                step(scheduler, outcome)
        return drive(scheduler, outcome=outcome), scheduler

    sync, _ = run(False)
    overlapped, scheduler = run(True)
    assert overlapped.tokens == sync.tokens
    for rid, lps in sync.logprobs.items():
        gaps = [abs(a.logprob - b.logprob) for a, b in zip(lps, overlapped.logprobs[rid], strict=True)]
        assert max(gaps) <= 1e-4, (rid, gaps)
    assert scheduler.prefill_overlap.overlapped_decode_steps > 0
    assert scheduler.load().kv_pages_used == 0
