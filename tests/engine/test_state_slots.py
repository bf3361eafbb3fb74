"""State slots in the scheduler (engine/kv/state_pool.py): taken with the pages at admission,
given back on finish, abort and preemption; a request with no free slot waits; each row carries its
request's slot."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.contract import ContractError, Finished, FinishReason, Request, SamplingParams
from engine.kv.state_pool import PADDING_SLOT, SlotPool, StatePools, StateShape
from engine.runner import SampledToken, StepBatch
from engine.scheduler import BatchScheduler
from models.sim import EOS_TOKEN_ID, VOCAB_SIZE, SimOptions, SimRunner


class SlotSpy:
    """The sim, recording which slot each request's rows carried."""

    def __init__(self, inner: SimRunner) -> None:
        self.inner = inner
        self.slots: dict[str, set[int]] = {}
        self.live_per_step: list[set[int]] = []

    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        step_slots = [r.state_slot for r in batch.rows]
        assert PADDING_SLOT not in step_slots, "a request's row carried the padding slot"
        assert len(set(step_slots)) == len(step_slots), f"two rows share a slot: {step_slots}"
        for row in batch.rows:
            self.slots.setdefault(row.request_id, set()).add(row.state_slot)
        self.live_per_step.append(set(step_slots))
        return self.inner.execute(batch)


def make(slots: int, max_num_seqs: int = 8, num_pages: int = 4096) -> tuple[BatchScheduler, SlotSpy]:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, enable_prefix_caching=False)
    groups = SimOptions(engine=config, num_kv_pages=num_pages).kv_groups()
    spy = SlotSpy(SimRunner(groups))
    scheduler = BatchScheduler(
        spy, config, groups, {EOS_TOKEN_ID}, 4096, model_id="sim", vocab_size=VOCAB_SIZE, state_slots=slots
    )
    return scheduler, spy


def run(scheduler: BatchScheduler, limit: int = 10_000) -> dict[str, object]:
    terminals: dict[str, object] = {}
    steps = 0
    while scheduler.has_work():
        for update in scheduler.step().updates:
            if update.terminal is not None:
                terminals[update.request_id] = update.terminal
        steps += 1
        assert steps < limit
    return terminals


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_a_request_without_a_free_slot_waits_and_gets_one_later() -> None:
    # 3 slots (2 usable) for up to 8 running requests: the slots bound concurrency.
    scheduler, spy = make(slots=3)
    for i in range(5):
        scheduler.submit(Request(f"r{i}", tuple(range(10 + i, 20 + i)), greedy(4)))
    scheduler.step()
    load = scheduler.load()
    assert (load.running, load.waiting, load.state_slots_used, load.state_slots_total) == (2, 3, 2, 2)
    terminals = run(scheduler)
    assert all(terminals[f"r{i}"] == Finished(FinishReason.LENGTH, 10, 4) for i in range(5))
    assert max(len(live) for live in spy.live_per_step) == 2
    assert all(len(s) == 1 for s in spy.slots.values()), spy.slots  # one slot per request, kept
    assert scheduler.load().state_slots_used == 0


def test_abort_and_preemption_give_the_slot_back() -> None:
    # 6 pages of 16 tokens (5 usable): all three fit at first, but two 20-token prompts growing to
    # 40 tokens (3 pages each) cannot both fit.
    scheduler, _ = make(slots=4, num_pages=6)
    scheduler.submit(Request("a", tuple(range(1, 21)), greedy(20)))
    scheduler.submit(Request("b", tuple(range(2, 22)), greedy(20)))
    scheduler.submit(Request("c", tuple(range(3, 8)), greedy(40)))
    scheduler.step()
    assert scheduler.load().state_slots_used == 3
    scheduler.abort("c")
    assert scheduler.load().state_slots_used == 2
    terminals = run(scheduler)
    assert scheduler.num_preemptions > 0
    assert terminals["a"] == Finished(FinishReason.LENGTH, 20, 20)
    assert terminals["b"] == Finished(FinishReason.LENGTH, 20, 20)
    assert "c" not in terminals
    assert scheduler.load().state_slots_used == 0


def test_a_stateful_scheduler_refuses_prefix_caching_and_async_prefill() -> None:
    groups = SimOptions(num_kv_pages=64).kv_groups()
    runner = SimRunner(groups)
    for bad in (EngineConfig(), EngineConfig(enable_prefix_caching=False, async_prefill=True)):
        with pytest.raises(ContractError):
            BatchScheduler(runner, bad, groups, {EOS_TOKEN_ID}, 64, model_id="sim", state_slots=4)


def test_slot_pool_and_state_pools() -> None:
    pool = SlotPool(3)
    assert (pool.take(), pool.take(), pool.take()) == (1, 2, None)
    pool.release(1)
    assert pool.take() == 1
    with pytest.raises(RuntimeError, match="not taken"):
        pool.release(0)
    shape = StateShape(num_layers=3, conv=(3, 40), recurrent=(4, 8, 16))
    state = StatePools(shape, torch_dtype(), device_cpu())
    state.allocate(5)
    assert state.num_slots == 5
    assert state.recurrent_layer(2).shape == (5, 4, 8, 16) and state.conv_layer(0).shape == (5, 3, 40)
    assert state.bytes_per_slot() == 3 * (3 * 40 * 2 + 4 * 8 * 16 * 4)


def torch_dtype():  # type: ignore[no-untyped-def]
    import torch

    return torch.bfloat16


def device_cpu():  # type: ignore[no-untyped-def]
    import torch

    return torch.device("cpu")
