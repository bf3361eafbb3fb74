"""Randomized workloads against the BatchScheduler: arrivals over time, shared prefixes, aborts,
tight KV, odd budgets and sliding windows. Whatever happens, every surviving request gets exactly
the sim's completion, every terminal comes once, and nothing is left behind."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.contract import Finished, Request, SamplingParams, Terminal
from engine.runner import SampledToken, StepBatch
from engine.scheduler import BatchScheduler
from models.sim import EOS_TOKEN_ID, VOCAB_SIZE, SimOptions, SimRunner, sim_completion


class _Checked:
    def __init__(self, inner: SimRunner, budget: int, max_num_seqs: int) -> None:
        self.inner = inner
        self.budget = budget
        self.max_num_seqs = max_num_seqs

    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        assert 0 < batch.num_tokens <= self.budget
        assert len(batch.rows) <= self.max_num_seqs
        assert len({r.request_id for r in batch.rows}) == len(batch.rows)
        return self.inner.execute(batch)


def _workload(rng: random.Random, n: int, max_len: int) -> list[Request]:
    stems = [tuple(rng.randrange(32, 127) for _ in range(rng.randint(10, 40))) for _ in range(3)]
    out = []
    for i in range(n):
        stem = rng.choice(stems) if rng.random() < 0.6 else ()
        tail = tuple(rng.randrange(32, 127) for _ in range(rng.randint(1, 30)))
        prompt = (stem + tail)[: max_len - 1]
        max_tokens = rng.randint(1, min(40, max_len - len(prompt)))
        sampling = SamplingParams(
            max_tokens=max_tokens,
            seed=rng.choice([None, 0, i]),
            ignore_eos=rng.random() < 0.3,
            logprobs=rng.choice([None, None, 0, 2]),
        )
        out.append(Request(f"q{i}", prompt, sampling))
    return out


@pytest.mark.parametrize("case", range(40))
def test_randomized_workload(case: int) -> None:
    rng = random.Random(1000 + case)
    max_len = 96
    num_pages = rng.randint(max_len // 16 + 1, 40)
    budget = rng.choice([1, 7, 16, 17, 40, 300])
    max_num_seqs = rng.choice([1, 3, 8, 64])
    sliding = rng.choice([None, None, 20, 40])
    config = EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_prefix_caching=rng.random() < 0.7
    )
    groups = SimOptions(engine=config, num_kv_pages=num_pages, sliding_window=sliding).kv_groups()
    runner = _Checked(SimRunner(groups), budget, max_num_seqs)
    scheduler = BatchScheduler(
        runner, config, groups, {EOS_TOKEN_ID}, max_len, model_id="sim", vocab_size=VOCAB_SIZE
    )

    pending = _workload(rng, 25, max_len)
    requests = {r.request_id: r for r in pending}
    tokens: dict[str, list[int]] = {}
    terminals: dict[str, Terminal] = {}
    aborted: set[str] = set()
    submitted: list[str] = []
    steps = 0
    while pending or scheduler.has_work():
        for _ in range(rng.randint(0, 3)):
            if pending:
                r = pending.pop(0)
                scheduler.submit(r)
                submitted.append(r.request_id)
        if rng.random() < 0.08:
            live = [rid for rid in submitted if rid not in terminals and rid not in aborted]
            if live:
                victim = rng.choice(live)
                scheduler.abort(victim)
                aborted.add(victim)
        if not scheduler.has_work():
            continue
        updates = scheduler.step().updates
        steps += 1
        assert steps < 20_000
        for u in updates:
            assert u.request_id not in terminals and u.request_id not in aborted
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.terminal is not None:
                terminals[u.request_id] = u.terminal
        load = scheduler.load()
        assert load.running <= max_num_seqs
        for group in load.groups:
            assert 0 <= group.pages_used <= group.pages_total

    assert set(terminals) | aborted == set(requests)
    for rid, terminal in terminals.items():
        request = requests[rid]
        expected = sim_completion(request.prompt_token_ids, request.sampling)
        assert tokens.get(rid, []) == list(expected.token_ids), rid
        assert terminal == Finished(
            expected.finish_reason, len(request.prompt_token_ids), len(expected.token_ids)
        )
    load = scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)
    for group in scheduler.kv.groups:
        assert group.pool.available == group.pool.total
