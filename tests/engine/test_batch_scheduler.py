"""The generic BatchScheduler, driven over the sim's runner (whose tokens depend on the history
only through the paged KV, so every scheduling mistake shows up as a wrong token).

Synchronous steps (`async_scheduling=False`): what one step schedules and returns is judged here;
test_async_scheduling.py drives the same scheduler both ways, where a step returns the tokens of
the one launched before it."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from engine.config import EngineConfig
from engine.contract import (
    Failed,
    Finished,
    FinishReason,
    Rejected,
    RejectReason,
    Request,
    SamplingParams,
    Terminal,
    TokenLogprob,
)
from engine.kv import KVGroupSpec
from engine.runner import SampledToken, StepBatch
from engine.scheduler import BatchScheduler, RunnerContractError
from models.sim import EOS_TOKEN_ID, VOCAB_SIZE, SimOptions, SimRunner, sim_completion


class SpyRunner:
    """Runs the sim and records every batch; `before` sees each batch before it runs."""

    def __init__(self, inner: SimRunner) -> None:
        self.inner = inner
        self.batches: list[StepBatch] = []
        self.before: Callable[[StepBatch], None] | None = None

    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        self.batches.append(batch)
        if self.before is not None:
            self.before(batch)
        return self.inner.execute(batch)


def make(
    *,
    num_pages: int = 4096,
    budget: int = 2048,
    max_num_seqs: int = 256,
    sliding: int | None = None,
    max_model_len: int = 4096,
    prefix: bool = True,
) -> tuple[BatchScheduler, SpyRunner]:
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix,
        async_scheduling=False,
    )
    groups = SimOptions(engine=config, num_kv_pages=num_pages, sliding_window=sliding).kv_groups()
    spy = SpyRunner(SimRunner(groups))
    scheduler = BatchScheduler(
        spy, config, groups, {EOS_TOKEN_ID}, max_model_len, model_id="sim", vocab_size=VOCAB_SIZE
    )
    return scheduler, spy


@dataclass
class Outcome:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    terminals: dict[str, Terminal] = field(default_factory=dict)
    admissions: Counter[str] = field(default_factory=Counter)
    cached: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    def absorb(self, outputs_updates: Sequence) -> None:
        ids = [u.request_id for u in outputs_updates]
        assert len(ids) == len(set(ids)), f"more than one update per request in a step: {ids}"
        for u in outputs_updates:
            assert u.request_id not in self.terminals, f"{u.request_id} updated after its terminal"
            if u.admission is not None:
                self.admissions[u.request_id] += 1
            if u.cached_tokens is not None:
                assert u.request_id not in self.cached
                self.cached[u.request_id] = u.cached_tokens
            self.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.logprobs is not None:
                self.logprobs.setdefault(u.request_id, []).extend(u.logprobs)
            if u.terminal is not None:
                self.terminals[u.request_id] = u.terminal


def drive(
    scheduler: BatchScheduler,
    requests: Sequence[Request] = (),
    outcome: Outcome | None = None,
    after_step: Callable[[int], None] | None = None,
    max_steps: int = 100_000,
) -> Outcome:
    outcome = outcome or Outcome()
    for request in requests:
        scheduler.submit(request)
    while scheduler.has_work():
        outcome.absorb(scheduler.step().updates)
        outcome.steps += 1
        if after_step is not None:
            after_step(outcome.steps)
        assert outcome.steps < max_steps, "scheduler made no progress"
    return outcome


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(32, 127) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def requests_for(
    ps: Sequence[tuple[int, ...]], max_tokens: int = 24, prefix: str = "r", **sampling: object
) -> list[Request]:
    return [
        Request(f"{prefix}{i}", p, SamplingParams(max_tokens=max_tokens, seed=i, **sampling))  # type: ignore[arg-type]
        for i, p in enumerate(ps)
    ]


def assert_matches_sim(outcome: Outcome, requests: Sequence[Request]) -> None:
    """Every request got exactly the sim's completion and one Finished terminal with its tally."""
    for r in requests:
        expected = sim_completion(r.prompt_token_ids, r.sampling)
        got = outcome.tokens.get(r.request_id, [])
        assert got == list(expected.token_ids), r.request_id
        assert outcome.terminals[r.request_id] == Finished(
            expected.finish_reason, len(r.prompt_token_ids), len(expected.token_ids)
        )
        assert outcome.admissions[r.request_id] == 1
        if r.sampling.logprobs is not None:
            assert outcome.logprobs[r.request_id] == list(expected.logprobs or ())


def assert_idle_and_empty(scheduler: BatchScheduler) -> None:
    load = scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)
    assert not scheduler.has_work()


# -- chunked prefill -----------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 15, 16, 17, 33, 4096])
def test_chunked_prefill_gives_the_same_tokens_as_unchunked(budget: int) -> None:
    reqs = requests_for(prompts(5, 20, 70, seed=budget), max_tokens=12, logprobs=2)
    whole, _ = make(budget=4096)
    reference = drive(whole, reqs)
    scheduler, spy = make(budget=budget)
    outcome = drive(scheduler, reqs)
    assert outcome.tokens == reference.tokens
    assert_matches_sim(outcome, reqs)
    assert all(b.num_tokens <= budget for b in spy.batches)
    chunks = {len(r.token_ids) for b in spy.batches for r in b.rows if not r.sample}
    if budget < 20:
        assert budget in chunks, f"no prefill chunk of the full budget {budget}: {sorted(chunks)}"
    assert_idle_and_empty(scheduler)


def test_decode_rows_come_first_and_mix_with_prefill_chunks() -> None:
    reqs = requests_for(prompts(12, 30, 90, seed=3), max_tokens=20, ignore_eos=True)
    scheduler, spy = make(budget=40)
    mixed = 0

    def check(batch: StepBatch) -> None:
        # Judged while the step runs: a row's context is the request's live token list.
        nonlocal mixed
        kinds = [
            "decode" if r.num_generated and r.start_pos == len(r.context) - 1 else "prefill"
            for r in batch.rows
        ]
        assert kinds == sorted(kinds), "a prefill row came before a decode row"
        mixed += "decode" in kinds and "prefill" in kinds

    spy.before = check
    outcome = Outcome()
    for i, request in enumerate(reqs):  # staggered arrivals keep prefills beside decodes
        scheduler.submit(request)
        if i % 3 == 2:
            for _ in range(4):
                outcome.absorb(scheduler.step().updates)
    drive(scheduler, outcome=outcome)
    assert mixed > 0
    assert_matches_sim(outcome, reqs)


def test_a_long_prompt_is_split_under_the_budget() -> None:
    (request,) = requests_for(prompts(1, 100, 100), max_tokens=3, ignore_eos=True)
    scheduler, spy = make(budget=17)
    outcome = drive(scheduler, [request])
    starts = [b.rows[0].start_pos for b in spy.batches[:6]]
    assert starts == [0, 17, 34, 51, 68, 85]
    assert [r.sample for b in spy.batches[:6] for r in b.rows] == [False] * 5 + [True]
    assert_matches_sim(outcome, [request])


# -- admission -----------------------------------------------------------------------------------


def test_admission_is_bounded_by_max_num_seqs() -> None:
    reqs = requests_for(prompts(20, 5, 40, seed=4), max_tokens=10)
    scheduler, spy = make(max_num_seqs=4)
    peak = 0

    def check(_: int) -> None:
        nonlocal peak
        peak = max(peak, scheduler.load().running)

    outcome = drive(scheduler, reqs, after_step=check)
    assert peak == 4
    assert max(len(b.rows) for b in spy.batches) == 4
    assert_matches_sim(outcome, reqs)


def test_admission_is_bounded_by_kv_pages_and_queues_the_rest() -> None:
    # 12 allocatable pages; each request needs up to 4 (a 40-token prompt plus 20 tokens).
    reqs = requests_for(prompts(8, 40, 40, seed=5), max_tokens=20, ignore_eos=True)
    scheduler, spy = make(num_pages=13, prefix=False)
    waiting_seen = 0

    def check(batch: StepBatch) -> None:
        nonlocal waiting_seen
        load = scheduler.load()
        assert load.kv_pages_used <= load.kv_pages_total == 12
        waiting_seen = max(waiting_seen, load.waiting)

    spy.before = check
    outcome = drive(scheduler, reqs)
    assert waiting_seen > 0
    assert_matches_sim(outcome, reqs)
    assert_idle_and_empty(scheduler)


def test_admission_happens_inside_a_step_never_on_submit() -> None:
    scheduler, spy = make()
    (request,) = requests_for(prompts(1, 5, 5))
    scheduler.submit(request)
    assert scheduler.load().waiting == 1 and scheduler.load().running == 0 and not spy.batches
    first = scheduler.step()
    assert first.updates[0].admission is not None
    assert first.updates[0].admission.prompt_tokens == 5


# -- preemption ----------------------------------------------------------------------------------


def test_preemption_under_kv_pressure_gives_the_same_tokens() -> None:
    reqs = requests_for(prompts(10, 20, 50, seed=6), max_tokens=40, ignore_eos=True, logprobs=1)
    free, _ = make(prefix=False)
    reference = drive(free, reqs)
    scheduler, _ = make(num_pages=12, budget=64, prefix=False)
    outcome = drive(scheduler, reqs)
    assert scheduler.num_preemptions > 0
    assert outcome.tokens == reference.tokens
    assert_matches_sim(outcome, reqs)
    assert_idle_and_empty(scheduler)


def test_preemption_takes_the_most_recently_admitted_first() -> None:
    reqs = requests_for(prompts(3, 30, 30, seed=7), max_tokens=60, ignore_eos=True)
    # 9 allocatable pages: all three fit at first (2 pages each) but cannot all grow.
    scheduler, _spy = make(num_pages=10, budget=256, prefix=False)
    outcome = Outcome()
    for r in reqs:
        scheduler.submit(r)
    while scheduler.num_preemptions == 0:
        outcome.absorb(scheduler.step().updates)
    # The newest admission went back to the front of the waiting queue; the oldest kept running.
    assert next(s.request_id for s in scheduler._waiting) == "r2"
    assert "r0" in {s.request_id for s in scheduler._running}
    drive(scheduler, outcome=outcome)
    assert_matches_sim(outcome, reqs)


def test_preemption_with_prefix_cache_reuses_its_own_pages() -> None:
    reqs = requests_for(prompts(6, 40, 60, seed=8), max_tokens=50, ignore_eos=True)
    scheduler, _spy = make(num_pages=20, budget=48)
    outcome = drive(scheduler, reqs)
    assert scheduler.num_preemptions > 0
    assert_matches_sim(outcome, reqs)
    assert_idle_and_empty(scheduler)


# -- prefix cache --------------------------------------------------------------------------------


def test_prefix_hit_reports_cached_tokens_and_gives_identical_tokens() -> None:
    shared = prompts(1, 70, 70, seed=9)[0]
    first = Request("first", (*shared, 65, 66), SamplingParams(max_tokens=16, seed=1))
    scheduler, spy = make()
    cold = drive(scheduler, [first])
    assert cold.cached["first"] == 0
    computed_before = spy.inner.tokens_computed
    second = Request("second", (*shared, 67), SamplingParams(max_tokens=16, seed=2, logprobs=3))
    same = Request("same", first.prompt_token_ids, first.sampling)
    warm = drive(scheduler, [second, same])
    assert warm.cached["second"] == 64 and warm.cached["same"] == 64
    # Both re-used four pages each instead of computing them.
    assert spy.inner.tokens_computed - computed_before < 2 * 72
    assert warm.tokens["same"] == cold.tokens["first"]
    assert_matches_sim(warm, [second, same])
    assert_idle_and_empty(scheduler)


def test_prefix_hit_from_a_running_request() -> None:
    shared = prompts(1, 50, 50, seed=10)[0]
    a = Request("a", shared, SamplingParams(max_tokens=30, ignore_eos=True))
    b = Request("b", (*shared, 1, 2, 3), SamplingParams(max_tokens=5, seed=4))
    scheduler, _ = make()
    outcome = Outcome()
    scheduler.submit(a)
    outcome.absorb(scheduler.step().updates)  # a's prompt is now written
    outcome = drive(scheduler, [b], outcome=outcome)
    assert outcome.cached["b"] == 48
    assert_matches_sim(outcome, [a, b])


def test_prefix_cache_off_reports_zero_and_still_matches() -> None:
    shared = prompts(1, 50, 50, seed=11)[0]
    reqs = [Request(f"p{i}", shared, SamplingParams(max_tokens=8, seed=i)) for i in range(3)]
    scheduler, _ = make(prefix=False)
    outcome = drive(scheduler, reqs)
    assert set(outcome.cached.values()) == {0}
    assert_matches_sim(outcome, reqs)


# -- abort ---------------------------------------------------------------------------------------


def test_abort_frees_pages_at_once_and_emits_nothing_further() -> None:
    reqs = requests_for(prompts(4, 40, 60, seed=12), max_tokens=50, ignore_eos=True)
    scheduler, _ = make(max_num_seqs=3, prefix=False)
    outcome = Outcome()
    for r in reqs:
        scheduler.submit(r)
    for _ in range(3):
        outcome.absorb(scheduler.step().updates)
    assert scheduler.load().waiting == 1
    used = scheduler.load().kv_pages_used
    held = scheduler.kv.live_pages("r1")[0]
    assert held > 0
    scheduler.abort("r1")  # running
    scheduler.abort("r3")  # waiting
    scheduler.abort("never-seen")  # a no-op
    assert scheduler.load().kv_pages_used == used - held
    assert scheduler.load().running == 2 and scheduler.load().waiting == 0
    seen_before = list(outcome.tokens["r1"])
    drive(scheduler, outcome=outcome)
    assert outcome.tokens["r1"] == seen_before
    assert "r1" not in outcome.terminals and "r3" not in outcome.terminals
    assert_matches_sim(outcome, [reqs[0], reqs[2]])
    assert_idle_and_empty(scheduler)


def test_abort_of_a_preempted_request_frees_everything() -> None:
    reqs = requests_for(prompts(4, 30, 30, seed=13), max_tokens=60, ignore_eos=True)
    scheduler, _ = make(num_pages=10, budget=256)
    outcome = Outcome()
    for r in reqs:
        scheduler.submit(r)
    while scheduler.num_preemptions == 0:
        outcome.absorb(scheduler.step().updates)
    victim = scheduler._waiting[0].request_id
    scheduler.abort(victim)
    drive(scheduler, outcome=outcome)
    assert victim not in outcome.terminals
    assert_matches_sim(outcome, [r for r in reqs if r.request_id != victim])
    assert_idle_and_empty(scheduler)


# -- sliding windows -----------------------------------------------------------------------------


@pytest.mark.parametrize(("window", "budget"), [(32, 8), (20, 16), (48, 1), (17, 40)])
def test_sliding_window_release_keeps_at_most_window_plus_chunk(window: int, budget: int) -> None:
    reqs = requests_for(prompts(4, 60, 120, seed=window), max_tokens=40, ignore_eos=True)
    scheduler, spy = make(sliding=window, budget=budget)
    bound = (window + budget - 2) // 16 + 2
    peak = 0

    def check(batch: StepBatch) -> None:
        nonlocal peak
        for row in batch.rows:
            full, sliding = scheduler.kv.live_pages(row.request_id)
            assert sliding <= bound, (row.request_id, sliding, bound)
            assert full == -(-row.end_pos // 16)
            peak = max(peak, sliding)

    spy.before = check
    outcome = drive(scheduler, reqs)
    # The runner checks, per row, that the oldest position the window needs is still there.
    assert_matches_sim(outcome, reqs)
    assert peak <= bound < -(-160 // 16)
    assert_idle_and_empty(scheduler)


# -- scale ---------------------------------------------------------------------------------------


def test_256_concurrent_requests_finish_and_leave_nothing_behind() -> None:
    reqs = requests_for(prompts(256, 100, 400, seed=14), max_tokens=32)
    # A budget that admits all 256 in the first step, so they really run side by side.
    scheduler, spy = make(num_pages=8192, budget=1 << 17)
    outcome = drive(scheduler, reqs)
    assert len(spy.batches[0].rows) == 256
    reasons = Counter(t.reason for t in outcome.terminals.values() if isinstance(t, Finished))
    assert reasons[FinishReason.STOP] > 0 and reasons[FinishReason.LENGTH] > 0
    assert_matches_sim(outcome, reqs)
    assert_idle_and_empty(scheduler)


# -- rejection, stop, length ---------------------------------------------------------------------


def test_rejections_are_decided_in_a_step_and_do_not_block_the_queue() -> None:
    scheduler, _ = make(num_pages=9, max_model_len=200)  # 8 pages = 128 tokens of KV
    too_long = Request("ctx", tuple(range(32, 132)), SamplingParams(max_tokens=101))
    too_big = Request("kv", tuple(range(32, 132)), SamplingParams(max_tokens=60))
    bad_token = Request("tok", (65, VOCAB_SIZE + 3), SamplingParams(max_tokens=4))
    fine = Request("ok", (65, 66, 67), SamplingParams(max_tokens=4))
    for r in (too_long, too_big, bad_token, fine):
        scheduler.submit(r)
    assert scheduler.load().waiting == 4
    outcome = drive(scheduler)
    assert outcome.terminals["ctx"] == Rejected(RejectReason.CONTEXT_LENGTH, outcome.terminals["ctx"].message)
    assert "200" in outcome.terminals["ctx"].message
    assert (
        isinstance(outcome.terminals["kv"], Rejected)
        and outcome.terminals["kv"].reason is RejectReason.KV_BUDGET
    )
    assert isinstance(outcome.terminals["tok"], Rejected)
    assert outcome.terminals["tok"].reason is RejectReason.INVALID_INPUT
    for rid in ("ctx", "kv", "tok"):
        assert outcome.admissions[rid] == 0 and outcome.tokens.get(rid, []) == []
    assert_matches_sim(outcome, [fine])
    assert_idle_and_empty(scheduler)


def test_a_request_that_exactly_fits_is_not_rejected() -> None:
    scheduler, _ = make(num_pages=9, max_model_len=129)
    # 100 + 29 = 129 tokens, but the last is never fed back: 128 positions = 8 pages.
    exact = Request("exact", tuple(range(32, 132)), SamplingParams(max_tokens=29, ignore_eos=True))
    outcome = drive(scheduler, [exact])
    assert_matches_sim(outcome, [exact])
    assert len(outcome.tokens["exact"]) == 29


def test_eos_stops_without_being_emitted_and_ignore_eos_runs_to_length() -> None:
    ps = prompts(40, 3, 10, seed=15)
    stopping = requests_for(ps, max_tokens=200, prefix="s")
    ignoring = requests_for(ps, max_tokens=60, prefix="i", ignore_eos=True)
    scheduler, _ = make()
    outcome = drive(scheduler, stopping + ignoring)
    assert_matches_sim(outcome, stopping + ignoring)
    stopped = [r for r in stopping if outcome.terminals[r.request_id].reason is FinishReason.STOP]  # type: ignore[union-attr]
    assert stopped
    assert all(EOS_TOKEN_ID not in outcome.tokens[r.request_id] for r in stopping)
    assert all(len(outcome.tokens[r.request_id]) == 60 for r in ignoring)


# -- failures ------------------------------------------------------------------------------------


def test_fail_step_fails_exactly_that_batch_and_serves_the_rest() -> None:
    scheduler, spy = make(max_num_seqs=2)
    reqs = requests_for(prompts(4, 10, 30, seed=16), max_tokens=10, ignore_eos=True)
    armed = True

    def blow_up(batch: StepBatch) -> None:
        nonlocal armed
        if armed and any(r.request_id == "r1" for r in batch.rows) and batch.rows[0].num_generated >= 2:
            armed = False
            raise RuntimeError("injected")

    spy.before = blow_up
    outcome = Outcome()
    for r in reqs:
        scheduler.submit(r)
    while scheduler.has_work():
        try:
            updates = scheduler.step().updates
        except RuntimeError:
            failed_batch = {r.request_id for r in spy.batches[-1].rows}
            updates = scheduler.fail_step("step failed: injected").updates
        outcome.absorb(updates)
    assert failed_batch == {"r0", "r1"}
    for rid in failed_batch:
        assert outcome.terminals[rid] == Failed("step failed: injected")
    assert_matches_sim(outcome, reqs[2:])
    assert_idle_and_empty(scheduler)


def test_runner_that_answers_with_the_wrong_shape_is_an_error() -> None:
    class Broken:
        def execute(self, batch: StepBatch) -> list[SampledToken | None]:
            return []

    groups = (KVGroupSpec("full", 16),)
    config = EngineConfig(async_scheduling=False)
    scheduler = BatchScheduler(Broken(), config, groups, {EOS_TOKEN_ID}, 100, model_id="x")
    scheduler.submit(Request("a", (1, 2)))
    with pytest.raises(RunnerContractError):
        scheduler.step()
    outputs = scheduler.fail_step("broken runner")
    assert outputs.updates[0].terminal == Failed("broken runner")
    assert_idle_and_empty(scheduler)


def test_length_finish_at_max_model_len() -> None:
    # prompt + max_tokens == max_model_len: the last token ends the request on both counts.
    scheduler, _ = make(max_model_len=24)
    r = Request("edge", tuple(range(40, 60)), SamplingParams(max_tokens=4, ignore_eos=True))
    outcome = drive(scheduler, [r])
    assert outcome.terminals["edge"] == Finished(FinishReason.LENGTH, 20, 4)
