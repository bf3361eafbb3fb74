"""Async scheduling (`EngineConfig.async_scheduling`): each step launches the next forward before it
reads the previous one's tokens, and must give exactly what synchronous scheduling gives.

Over the sim every token is a function of the history read back through the paged KV, so a fed
token that is wrong, a page freed while a launched step still writes it, or a fact recorded twice
shows up as a wrong token, a `SimKVError` or a `LifecycleError`. `LateDevice` stands in for a
device that runs launched steps late but in order: a step's forward runs only when it (or a later
one) is collected, so the scheduler's host work really runs ahead of it, and each row's pages are
checked to be held when it is launched, a full group's still when its forward finally runs (and,
with recurrent state, each row's state slot and each snapshot slot the step writes;
tests/engine/test_async_state.py). The real lines (tiny
synthetic Qwen3 and Gemma 4 on CPU; Qwen3.5 in test_async_state.py) run
`PagedModelRunner.launch_step`, whose fed tokens are gathered from the previous step's sampled-id
tensor, and are compared with their own synchronous runs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from test_batch_scheduler import (  # the sibling module: pytest puts tests/engine on sys.path
    Outcome,
    assert_idle_and_empty,
    assert_matches_sim,
    drive,
    prompts,
)

from engine.config import EngineConfig
from engine.contract import ContractError, Failed, Request, SamplingParams
from engine.kv import KVGroupSpec
from engine.kv.state_pool import state_pools_of
from engine.runner import (
    FED_TOKEN,
    BatchRow,
    FeedError,
    ModelRunner,
    ReadyPrefill,
    SampledToken,
    StepBatch,
    StepHandle,
    resolve_feeds,
)
from engine.scheduler import BatchScheduler
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE
from models.registry import ModelOptions, load_model
from models.sim import EOS_TOKEN_ID, VOCAB_SIZE, SimOptions, SimRunner, sim_completion


class _LateHandle:
    def __init__(self, device: LateDevice, batch: StepBatch, feed: StepHandle | None) -> None:
        self.device = device
        self.batch = batch
        self.feed = feed
        self.results: ReadyPrefill | None = None
        self.collected = False

    def done(self) -> bool:
        return self.results is not None

    def wait(self) -> None:
        self.device.run_until(self)

    def collect(self) -> list[SampledToken | None]:
        assert not self.collected, "a launched step was collected twice"
        self.collected = True
        self.device.run_through(self)
        assert self.results is not None
        return self.results.results


class LateDevice:
    """Implements `engine.runner.PipelinedRunner` over a runner that runs at once (the sim, or one
    wrapping it); runs launches in order, late."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner
        self.queue: list[_LateHandle] = []
        self.launched: list[StepBatch] = []
        self.scheduler: BatchScheduler | None = None
        # Raised once from the next launch (a failing forward), or from the next collect.
        self.fail_launch: type[Exception] | None = None
        self.fail_collect: type[Exception] | None = None
        self.sync_steps = 0

    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        self.sync_steps += 1
        return self.inner.execute(batch)

    def launch_step(self, batch: StepBatch, feed: StepHandle | None) -> StepHandle:
        if self.fail_launch is not None:
            fault, self.fail_launch = self.fail_launch, None
            raise fault("injected launch failure")
        for row in batch.rows:
            if row.feed_from is not None:
                assert row.token_ids == (FED_TOKEN,) and row.sample and len(row.token_ids) == 1
                assert feed is not None, "a fed row without the step it is fed from"
        self._check_pages_held(batch, at_launch=True)
        handle = _LateHandle(self, batch, feed)
        self.queue.append(handle)
        self.launched.append(batch)
        return handle

    def run_through(self, handle: _LateHandle) -> None:
        if self.fail_collect is not None:
            fault, self.fail_collect = self.fail_collect, None
            raise fault("injected collect failure")
        self.run_until(handle)

    def run_until(self, handle: _LateHandle) -> None:
        """Run the queued launches in order up to `handle` (the device catching up)."""
        while handle.results is None:
            head = self.queue.pop(0)
            self._check_pages_held(head.batch, at_launch=False)
            self._check_slots_held(head.batch)
            feed = head.feed
            ready = feed.results if isinstance(feed, _LateHandle) else None
            head.results = ReadyPrefill(self.inner.execute(resolve_feeds(head.batch, ready)))

    def _check_pages_held(self, batch: StepBatch, *, at_launch: bool) -> None:
        """Every page a row's forward reads or writes is referenced when the step is launched (on a
        sliding group, those its first query's window reaches), and a full group's still when it
        runs. A sliding window may release a page while the step is in flight: the device runs
        launches in order, so whatever writes that page next runs after it (docs/engine.md)."""
        scheduler = self.scheduler
        assert scheduler is not None
        for row in batch.rows:
            for group, table in zip(scheduler.kv.groups, row.page_tables, strict=True):
                window = group.spec.sliding_window
                if window is not None and not at_launch:
                    continue
                first = 0 if window is None else max(0, row.start_pos - window + 1) // PAGE_SIZE
                for page in table[first:]:
                    if page != PADDING_PAGE:
                        assert group.pool.refcount(page) > 0, f"{row.request_id}: page {page} freed under it"

    def _check_slots_held(self, batch: StepBatch) -> None:
        """With recurrent state, when a step runs every row's state slot is still taken and every
        snapshot slot the step writes is still pending."""
        scheduler = self.scheduler
        assert scheduler is not None
        slots = scheduler._slots
        if slots is not None:
            for row in batch.rows:
                assert row.state_slot in slots._taken, f"{row.request_id}: state slot {row.state_slot} freed"
        snapshots = scheduler.kv.snapshots
        for _, dst in batch.snapshot_state:
            assert snapshots is not None and dst in snapshots._pending, f"snapshot slot {dst} not pending"


def make(
    *,
    async_scheduling: bool,
    num_pages: int = 4096,
    budget: int = 2048,
    max_num_seqs: int = 256,
    sliding: int | None = None,
    max_model_len: int = 4096,
    late: bool = True,
) -> tuple[BatchScheduler, LateDevice | SimRunner]:
    config = EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, async_scheduling=async_scheduling
    )
    groups = SimOptions(engine=config, num_kv_pages=num_pages, sliding_window=sliding).kv_groups()
    sim = SimRunner(groups)
    runner: LateDevice | SimRunner = LateDevice(sim) if late else sim
    scheduler = BatchScheduler(
        runner, config, groups, {EOS_TOKEN_ID}, max_model_len, model_id="sim", vocab_size=VOCAB_SIZE
    )
    if isinstance(runner, LateDevice):
        runner.scheduler = scheduler
    return scheduler, runner


def mixed_requests(n: int, seed: int, *, logprobs: int | None = 2) -> list[Request]:
    """Different prompt lengths and max_tokens; greedy, seeded and unseeded sampling; some rows that
    ignore EOS, most that stop on it."""
    rng = random.Random(seed)
    out = []
    for i, prompt in enumerate(prompts(n, 3, 60, seed=seed)):
        params = SamplingParams(
            max_tokens=rng.choice([1, 2, 5, 17, 40, 90]),
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.9]),
            seed=rng.choice([None, i]),
            ignore_eos=rng.random() < 0.2,
            logprobs=logprobs,
        )
        out.append(Request(f"q{i}", prompt, params))
    return out


def run_staggered(
    scheduler: BatchScheduler,
    requests: Sequence[Request],
    *,
    arrivals: Sequence[int],
    aborts: dict[int, list[str]] | None = None,
    check: Callable[[BatchScheduler], None] | None = None,
) -> Outcome:
    """Submit request i before step arrivals[i]; abort the named requests before those steps."""
    outcome = Outcome()
    step = 0
    pending = sorted(zip(arrivals, range(len(requests)), strict=True))
    while pending or scheduler.has_work():
        while pending and pending[0][0] <= step:
            scheduler.submit(requests[pending.pop(0)[1]])
        for rid in (aborts or {}).get(step, []):
            scheduler.abort(rid)
        outcome.absorb(scheduler.step().updates)
        outcome.steps += 1
        step += 1
        if check is not None:
            check(scheduler)
        assert step < 100_000, "no progress"
    return outcome


# -- the sim -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_async_gives_the_sync_runs_tokens_over_a_mixed_workload(seed: int) -> None:
    rng = random.Random(seed)
    reqs = mixed_requests(24, seed)
    arrivals = sorted(rng.randrange(0, 60) for _ in reqs)
    budget = rng.choice([7, 32, 2048])
    outcomes = {}
    for mode in (False, True):
        scheduler, runner = make(async_scheduling=mode, budget=budget, max_num_seqs=8)
        outcomes[mode] = run_staggered(scheduler, reqs, arrivals=arrivals)
        assert_idle_and_empty(scheduler)
        if mode:
            assert isinstance(runner, LateDevice)
            assert runner.sync_steps == 0, "an async step ran through execute"
            stats = scheduler.async_stats
            assert stats.launches == stats.collects > 0
            assert stats.fed_rows > 0
            # Rows fed a stop token (or retired) before their step was read: dropped, not emitted.
            assert stats.wasted_rows > 0
    assert outcomes[True].tokens == outcomes[False].tokens
    assert outcomes[True].logprobs == outcomes[False].logprobs
    assert outcomes[True].terminals == outcomes[False].terminals
    assert_matches_sim(outcomes[True], reqs)


def test_steps_run_one_late_and_fed_rows_name_the_previous_steps_row() -> None:
    scheduler, runner = make(async_scheduling=True)
    assert isinstance(runner, LateDevice)
    (request,) = [Request("a", (40, 41, 42), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]
    scheduler.submit(request)
    first = scheduler.step()
    # The prefill was launched, not read: admission only, no token yet.
    (update,) = first.updates
    assert update.admission is not None and update.new_token_ids == ()
    assert scheduler.has_work() and len(runner.queue) == 1
    second = scheduler.step()
    # The decode row was launched fed from the prefill's row 0, then the prefill's token was read.
    assert runner.launched[1].rows[0].feed_from == 0
    assert runner.launched[1].rows[0].token_ids == (FED_TOKEN,)
    assert runner.launched[1].rows[0].num_generated == 1
    expected = sim_completion(request.prompt_token_ids, request.sampling).token_ids
    assert second.updates[0].new_token_ids == (expected[0],)
    outcome = drive(scheduler)
    assert [t for u in outcome.tokens.values() for t in u] == list(expected[1:])
    # max_tokens=4: the fourth token's step is known to be the last, so no fifth row is launched.
    assert len(runner.launched) == 4
    assert_idle_and_empty(scheduler)


def test_a_stop_token_wastes_one_row_and_frees_pages_only_when_that_row_is_collected() -> None:
    # A prompt whose first generated token is EOS under the sim's rule.
    prompt = next(
        p
        for p in (tuple(random.Random(s).randrange(32, 127) for _ in range(5)) for s in range(10_000))
        if sim_completion(p, SamplingParams(max_tokens=8, temperature=0.0)).token_ids == ()
        and sim_completion(p, SamplingParams(max_tokens=8, temperature=0.0)).finish_reason.value == "stop"
    )
    scheduler, runner = make(async_scheduling=True)
    assert isinstance(runner, LateDevice)
    scheduler.submit(Request("s", prompt, SamplingParams(max_tokens=8, temperature=0.0)))
    scheduler.step()  # launches the prefill
    out = scheduler.step()  # launches a decode row fed with the (EOS) token, then reads the EOS
    assert out.updates[0].terminal is not None
    assert out.updates[0].new_token_ids == ()
    # The wasted decode row is still launched: its pages stay held until it is collected.
    assert scheduler.load().kv_pages_used > 0 and scheduler.has_work()
    assert scheduler.step().updates == ()
    assert scheduler.async_stats.wasted_rows == 1
    assert scheduler.async_stats.deferred_frees == 1
    assert_idle_and_empty(scheduler)


def test_aborts_mid_stream_emit_nothing_more_and_free_every_page() -> None:
    reqs = mixed_requests(20, seed=9)
    arrivals = list(range(0, 40, 2))
    aborts = {5: ["q0", "q1"], 11: ["q3"], 12: ["q4", "q17"], 30: ["q9", "q10", "q11"]}
    aborted = {rid for rids in aborts.values() for rid in rids}
    scheduler, _ = make(async_scheduling=True, budget=16, max_num_seqs=6)
    outcome = run_staggered(scheduler, reqs, arrivals=arrivals, aborts=aborts)
    assert_idle_and_empty(scheduler)
    cut_short = 0
    for r in reqs:
        expected = list(sim_completion(r.prompt_token_ids, r.sampling).token_ids)
        got = outcome.tokens.get(r.request_id, [])
        if r.request_id in aborted and r.request_id not in outcome.terminals:
            # Retired silently: what it streamed before the abort is a prefix of its completion.
            assert got == expected[: len(got)]
            cut_short += 1
        else:
            # Finished (an aborted one only if it finished before its abort arrived).
            assert got == expected, r.request_id
    assert cut_short >= 3
    assert scheduler.async_stats.deferred_frees > 0


def test_preemption_under_a_small_kv_budget_drains_first_and_matches_sync() -> None:
    reqs = [
        Request(
            f"p{i}", p, SamplingParams(max_tokens=60, seed=i, temperature=0.8, ignore_eos=True, logprobs=1)
        )
        for i, p in enumerate(prompts(10, 20, 50, seed=4))
    ]
    outcomes = {}
    for mode in (False, True):
        scheduler, _ = make(async_scheduling=mode, num_pages=24, budget=64)
        outcomes[mode] = run_staggered(scheduler, reqs, arrivals=[0, 0, 1, 2, 3, 5, 8, 13, 21, 34])
        assert scheduler.num_preemptions > 0
        assert_idle_and_empty(scheduler)
        if mode:
            assert scheduler.async_stats.drains > 0
    assert outcomes[True].tokens == outcomes[False].tokens
    assert outcomes[True].logprobs == outcomes[False].logprobs
    assert_matches_sim(outcomes[True], reqs)


@pytest.mark.parametrize("seed", range(4))
def test_randomized_pressure_windows_and_aborts(seed: int) -> None:
    rng = random.Random(100 + seed)
    reqs = mixed_requests(30, seed=100 + seed, logprobs=None)
    arrivals = sorted(rng.randrange(0, 80) for _ in reqs)
    aborts: dict[int, list[str]] = {}
    for r in rng.sample(reqs, 6):
        aborts.setdefault(rng.randrange(0, 120), []).append(r.request_id)
    scheduler, _ = make(
        async_scheduling=True,
        num_pages=40,
        budget=rng.choice([9, 33]),
        max_num_seqs=10,
        sliding=rng.choice([None, 20]),
    )

    def no_leak(s: BatchScheduler) -> None:
        load = s.load()
        assert load.kv_pages_used <= load.kv_pages_total

    outcome = run_staggered(scheduler, reqs, arrivals=arrivals, aborts=aborts, check=no_leak)
    assert_idle_and_empty(scheduler)
    aborted = {rid for rids in aborts.values() for rid in rids}
    for r in reqs:
        expected = list(sim_completion(r.prompt_token_ids, r.sampling).token_ids)
        got = outcome.tokens.get(r.request_id, [])
        if r.request_id in aborted and r.request_id not in outcome.terminals:
            assert got == expected[: len(got)]
        elif r.request_id not in outcome.terminals:
            raise AssertionError(f"{r.request_id} never finished")
        elif not isinstance(outcome.terminals[r.request_id], Failed):
            assert got == expected, r.request_id


def _most_sliding_pages(request: Request, async_scheduling: bool, window: int, chunk: int) -> tuple[int, int]:
    """The most pages the request held at once in the sliding group, and that group's bound."""
    scheduler, _ = make(async_scheduling=async_scheduling, budget=chunk, sliding=window)
    sliding = next(i for i, g in enumerate(scheduler.kv.groups) if g.spec.sliding_window)
    seen: list[int] = []
    outcome = run_staggered(
        scheduler, [request], arrivals=[0], check=lambda s: seen.append(s.kv.live_pages("long")[sliding])
    )
    assert_matches_sim(outcome, [request])
    positions = len(request.prompt_token_ids) + request.sampling.max_tokens
    return max(seen), scheduler.kv.groups[sliding].spec.max_live_pages(positions, chunk)


def test_a_chunked_prefill_holds_a_window_and_one_chunk_of_a_sliding_group_as_sync_does() -> None:
    """The sliding group's bound (`KVGroupSpec.max_live_pages`, which start-up sizes the group by)
    holds with a chunk in flight: the window releases from the positions scheduled, not from the
    step the device has finished (a window of 8 pages and chunks of 4 held up to 16 pages)."""
    request = Request(
        "long", prompts(1, 1000, 1000, seed=7)[0], SamplingParams(max_tokens=3, ignore_eos=True)
    )
    held = {mode: _most_sliding_pages(request, mode, window=128, chunk=64) for mode in (False, True)}
    for mode, (worst, bound) in held.items():
        assert 0 < worst <= bound, f"async={mode}: {worst} sliding pages held, bound {bound}"
    assert held[True] == held[False]


def test_a_runner_that_cannot_keep_tokens_on_a_device_runs_each_launch_at_once() -> None:
    """The plain sim (no `launch_step`): `engine.runner.launch_step` resolves fed rows from the
    previous step's host results and runs the step at launch; the scheduling is the same."""
    reqs = mixed_requests(12, seed=3)
    scheduler, runner = make(async_scheduling=True, late=False, max_num_seqs=4)
    outcome = run_staggered(scheduler, reqs, arrivals=list(range(12)))
    assert isinstance(runner, SimRunner) and runner.steps == scheduler.async_stats.launches
    assert scheduler.async_stats.fed_rows > 0
    assert_matches_sim(outcome, reqs)
    assert_idle_and_empty(scheduler)


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_failed_step_fails_both_steps_in_flight_and_frees_their_pages(where: str) -> None:
    scheduler, runner = make(async_scheduling=True)
    assert isinstance(runner, LateDevice)
    reqs = [
        Request(f"f{i}", (50 + i, 60, 70), SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(3)
    ]
    for r in reqs:
        scheduler.submit(r)
    outcome = Outcome()
    for _ in range(4):
        outcome.absorb(scheduler.step().updates)
    if where == "launch":
        runner.fail_launch = RuntimeError
    else:
        runner.fail_collect = RuntimeError
    with pytest.raises(RuntimeError, match="injected"):
        scheduler.step()
    outcome.absorb(scheduler.fail_step("boom").updates)
    assert {rid: type(t) for rid, t in outcome.terminals.items()} == {r.request_id: Failed for r in reqs}
    assert_idle_and_empty(scheduler)
    # The scheduler keeps serving.
    late = Request("after", (33, 34), SamplingParams(max_tokens=5, ignore_eos=True))
    outcome = drive(scheduler, [late])
    assert_matches_sim(outcome, [late])


def test_async_scheduling_is_refused_with_async_prefill_and_serves_recurrent_state() -> None:
    with pytest.raises(ContractError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, async_prefill=True)
    groups = (KVGroupSpec("full", 64),)
    for caching, snapshots in ((False, 0), (True, 4)):
        config = EngineConfig(async_scheduling=True, enable_prefix_caching=caching)
        scheduler = BatchScheduler(
            SimRunner(groups),
            config,
            groups,
            {EOS_TOKEN_ID},
            256,
            model_id="sim",
            state_slots=4,
            snapshot_slots=snapshots,
        )
        assert scheduler.load().state_slots_total == 3
    # Overlapped prefill stays refused for it, by name.
    with pytest.raises(ContractError, match="async_prefill"):
        BatchScheduler(
            SimRunner(groups),
            EngineConfig(async_prefill=True, enable_prefix_caching=False),
            groups,
            {EOS_TOKEN_ID},
            256,
            model_id="sim",
            state_slots=4,
        )


def test_the_flag_is_on_by_default_unless_prefill_overlaps_and_both_spellings_reach_the_config() -> None:
    from infer_cli.engine_options import KNOBS

    assert EngineConfig().async_scheduling_enabled
    assert not EngineConfig(async_scheduling=False).async_scheduling_enabled
    assert not EngineConfig(async_prefill=True).async_scheduling_enabled  # the other overlap instead
    knob = KNOBS["async_scheduling"]
    option = knob.option()
    assert option.param_decls == ("--async-scheduling/--no-async-scheduling",)


# -- real lines on CPU -------------------------------------------------------------------------


def _real_requests(eos_free: bool) -> list[Request]:
    specs = [
        # (prompt length, max_tokens, temperature, top_k, top_p, seed)
        (5, 20, 0.0, 0, 1.0, None),
        (21, 12, 0.8, 0, 1.0, 7),
        (12, 24, 1.0, 8, 0.9, 3),
        (33, 10, 0.0, 0, 1.0, None),
        (8, 20, 0.7, 0, 0.95, 11),
        (17, 6, 0.0, 0, 1.0, None),
    ]
    out = []
    for i, ((n, max_tokens, temperature, top_k, top_p, seed), prompt) in enumerate(
        zip(specs, prompts(len(specs), 40, 40, seed=21), strict=True)
    ):
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            logprobs=2,
            ignore_eos=eos_free,
        )
        out.append(Request(f"m{i}", prompt[:n], params))
    return out


# Builds the requests of a comparison from whether they ignore EOS (the probe run does).
RealRequests = Callable[[bool], list[Request]]


def _real_run(
    checkpoint: Path,
    async_scheduling: bool,
    eos: set[int] | None,
    aborts: dict[int, list[str]],
    *,
    num_kv_pages: int,
    budget: int,
    requests: RealRequests = _real_requests,
    arrivals: Sequence[int] = (0, 0, 2, 3, 5, 9),
) -> tuple[Outcome, BatchScheduler]:
    # `per-token` runs every projection and the LM head row by row, so a row's logits do not
    # depend on which other rows share its step: async scheduling changes the batches (a finished
    # request leaves a step later), and under `tuned` the two runs' log-probs differ in the last
    # bits (5e-7 measured on CPU) though the tokens agree.
    engine = EngineConfig(
        max_num_batched_tokens=budget,
        num_kv_pages=num_kv_pages,
        max_num_seqs=4,
        async_scheduling=async_scheduling,
        numeric_policy="per-token",
    )
    loaded = load_model(str(checkpoint), ModelOptions(engine=engine, device="cpu"))
    scheduler = loaded.scheduler
    assert isinstance(scheduler, BatchScheduler)
    if eos is not None:
        # The same runner, pages and state slots under a stop set the tiny random model samples.
        state = state_pools_of(scheduler.runner.model)  # type: ignore[attr-defined]
        scheduler = BatchScheduler(
            scheduler.runner,
            engine,
            [g.spec for g in scheduler.kv.groups],
            eos,
            loaded.max_model_len,
            model_id="stop-test",
            state_slots=None if state is None else state.running_slots,
            snapshot_slots=0 if state is None else state.snapshot_slots,
        )
    reqs = requests(eos is None)
    outcome = run_staggered(scheduler, reqs, arrivals=arrivals, aborts=aborts)
    load = scheduler.load()
    assert (load.kv_pages_used, load.state_slots_used) == (0, 0), load
    assert scheduler.kv.snapshots is None or scheduler.kv.snapshots.pending == 0
    return outcome, scheduler


def _max_logprob_gap(a: Outcome, b: Outcome, skip: str) -> float:
    gaps = [
        abs(x.logprob - y.logprob)
        for rid in a.logprobs
        if rid != skip
        for x, y in zip(a.logprobs[rid], b.logprobs[rid], strict=True)
    ]
    return max(gaps)


def _compare_real_line(
    checkpoint: Path,
    requests: RealRequests = _real_requests,
    arrivals: Sequence[int] = (0, 0, 2, 3, 5, 9),
) -> tuple[Outcome, BatchScheduler]:
    """Sync against async on the same requests (m0 stops on a token it samples, m2 is aborted):
    the same tokens, log-probs, terminals and prefix hits; then again under a KV pool of 6 pages
    that preempts. Returns the roomy async run."""

    def run(
        async_scheduling: bool, eos: set[int] | None, aborts: dict[int, list[str]], pages: int, budget: int
    ) -> tuple[Outcome, BatchScheduler]:
        return _real_run(
            checkpoint,
            async_scheduling,
            eos,
            aborts,
            num_kv_pages=pages,
            budget=budget,
            requests=requests,
            arrivals=arrivals,
        )

    # Budget 64 holds every prompt in one chunk and 64 pages hold every request at once: the sync
    # and async runs compute every row with the same shapes, so they must agree bit for bit.
    # Find a token the model samples mid-stream, and make it the stop token.
    probe, _ = run(False, None, {}, 64, 64)
    stop = probe.tokens["m0"][3]
    aborted = "m2"
    aborts = {14: [aborted]}
    sync, _ = run(False, {stop}, aborts, 64, 64)
    async_, scheduler = run(True, {stop}, aborts, 64, 64)
    stats = scheduler.async_stats
    assert stats.fed_rows > 0 and stats.launches == stats.collects and stats.wasted_rows > 0
    assert sync.terminals["m0"].reason.value == "stop"  # type: ignore[union-attr]
    assert async_.terminals == sync.terminals and aborted not in sync.terminals
    # The same prefix hits, so the same rows: a hit at another depth would compute other chunks.
    assert async_.cached == sync.cached
    for rid, tokens in sync.tokens.items():
        if rid == aborted:  # each run streamed a prefix, one step later under async scheduling
            shorter = min(len(tokens), len(async_.tokens[rid]))
            assert async_.tokens[rid][:shorter] == tokens[:shorter]
            continue
        assert async_.tokens[rid] == tokens, rid
        assert async_.logprobs.get(rid) == sync.logprobs.get(rid), rid

    # Under a KV budget that preempts, the two runs preempt at different steps, and a recomputed
    # prefix is one prefill chunk where it was many decode rows: its KV differs in the last bits.
    # The tolerance is that effect in the sync run itself (preempting vs roomy), measured here
    # (4.8e-7 on both tiny lines on CPU; the async gap was 0 on Qwen3 and 4.8e-7 on Gemma 4).
    sync_tight, sync_scheduler = run(False, {stop}, aborts, 6, 16)
    async_tight, tight_scheduler = run(True, {stop}, aborts, 6, 16)
    assert sync_scheduler.num_preemptions > 0 and tight_scheduler.num_preemptions > 0
    assert tight_scheduler.async_stats.drains > 0
    assert async_tight.terminals == sync_tight.terminals == sync.terminals
    for rid, tokens in sync.tokens.items():
        if rid != aborted:
            assert async_tight.tokens[rid] == sync_tight.tokens[rid] == tokens, rid
    own_error = _max_logprob_gap(sync_tight, sync, skip=aborted)
    assert _max_logprob_gap(async_tight, sync_tight, skip=aborted) <= own_error
    return async_, scheduler


def test_qwen3_tiny_async_gives_the_sync_tokens_and_logprobs(tiny_qwen3: Path) -> None:
    _compare_real_line(tiny_qwen3)


def test_gemma4_tiny_async_gives_the_sync_tokens_and_logprobs(tiny_gemma4: Path) -> None:
    _compare_real_line(tiny_gemma4)


def test_a_paged_runner_refuses_a_row_fed_from_a_step_it_did_not_launch(tiny_qwen3: Path) -> None:
    loaded = load_model(str(tiny_qwen3), ModelOptions(engine=EngineConfig(num_kv_pages=8), device="cpu"))
    runner = loaded.scheduler.runner  # type: ignore[attr-defined]
    pages = ((1,),) * len(runner.model.kv.attention_specs)
    plain = BatchRow("plain", (5,), 0, pages, True, SamplingParams(), (5,), 0)
    fed = BatchRow("fed", (FED_TOKEN,), 3, pages, True, SamplingParams(), (1, 2, 3), 1, feed_from=0)
    # The first fed row is named, whatever rows come before it.
    with pytest.raises(FeedError, match="row of 'fed' is fed from ReadyPrefill"):
        runner.launch_step(StepBatch((plain, fed)), ReadyPrefill([SampledToken(7)]))
    launched = runner.launch_step(StepBatch((plain,)), None)
    with pytest.raises(FeedError, match="row of 'fed': feed_from=1 names a row that sampled nothing"):
        runner.launch_step(StepBatch((replace(fed, feed_from=1),)), launched)
    # A row inside the step that sampled nothing is refused too; the one after it is fed.
    mixed = runner.launch_step(
        StepBatch((replace(plain, sample=False), replace(plain, request_id="b"))), None
    )
    with pytest.raises(FeedError, match="row of 'fed': feed_from=0 names a row that sampled nothing"):
        runner.launch_step(StepBatch((fed,)), mixed)
    assert runner.launch_step(StepBatch((replace(fed, feed_from=1),)), mixed).collect()[0] is not None


def test_a_paged_runner_feeds_each_row_the_token_its_feed_row_sampled(tiny_qwen3: Path) -> None:
    """Fed rows get exactly `feed`'s sampled token of row `feed_from`, at their offset in the packed
    step: the leading rows fed from the same rows in order (one slice copy), and every other layout
    (reordered, a subset, after a prefill chunk) through the index, are held to that definition."""
    loaded = load_model(str(tiny_qwen3), ModelOptions(engine=EngineConfig(num_kv_pages=8), device="cpu"))
    runner = loaded.scheduler.runner  # type: ignore[attr-defined]
    pages = ((1,),) * len(runner.model.kv.attention_specs)
    seen: list[list[int]] = []
    forward = runner.model.forward

    def recording_forward(step):  # type: ignore[no-untyped-def]
        seen.append(step.input_ids.tolist())
        return forward(step)

    runner.model.forward = recording_forward
    # Seeded random draws, so the three rows sample three different tokens.
    first = tuple(
        BatchRow(f"r{i}", (5 + i,), 0, pages, True, SamplingParams(temperature=1.0, seed=i), (5 + i,), 0)
        for i in range(3)
    )
    launched = runner.launch_step(StepBatch(first), None)
    sampled = [token.token_id for token in launched.collect()]
    assert len(set(sampled)) == 3, sampled

    def fed(i: int, feed_from: int) -> BatchRow:
        return BatchRow(
            f"r{i}", (FED_TOKEN,), 1, pages, True, SamplingParams(), (5 + i,), 1, feed_from=feed_from
        )

    prefill = BatchRow("p", (9, 10, 11), 0, pages, True, SamplingParams(), (9, 10, 11), 0)
    layouts = {
        "in order": ((fed(0, 0), fed(1, 1), fed(2, 2)), [sampled[0], sampled[1], sampled[2]]),
        "leading subset": ((fed(0, 0), fed(1, 1)), [sampled[0], sampled[1]]),
        "reordered": ((fed(0, 2), fed(1, 0), fed(2, 1)), [sampled[2], sampled[0], sampled[1]]),
        "shifted": ((fed(1, 1), fed(2, 2)), [sampled[1], sampled[2]]),
        "after a prefill chunk": ((prefill, fed(0, 0), fed(1, 1)), [9, 10, 11, sampled[0], sampled[1]]),
        "beside a plain row": ((fed(0, 0), replace(first[1], start_pos=1)), [sampled[0], 6]),
    }
    for name, (rows, expected) in layouts.items():
        seen.clear()
        runner.launch_step(StepBatch(rows), launched).collect()
        assert seen == [expected], name
