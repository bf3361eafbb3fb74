"""The Driver thread: serves a scheduler, blocks when idle, hands outputs to asyncio, survives a
failing step and reports a fatal one."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from engine.config import EngineConfig
from engine.contract import (
    EngineFatalError,
    Failed,
    Finished,
    Load,
    Request,
    RequestUpdate,
    SamplingParams,
    StepOutputs,
    Terminal,
)
from engine.driver import Driver
from engine.runner import StepBatch
from models.sim import SimOptions, build_sim, sim_completion


class CountingScheduler:
    """Forwards to a real scheduler and counts the calls the driver makes."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.has_work_calls = 0
        self.step_calls = 0

    def submit(self, request: Request) -> None:
        self.inner.submit(request)

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)

    def step(self) -> StepOutputs:
        self.step_calls += 1
        return self.inner.step()

    def fail_step(self, message: str) -> StepOutputs:
        return self.inner.fail_step(message)

    def load(self) -> Load:
        return self.inner.load()

    def has_work(self) -> bool:
        self.has_work_calls += 1
        return self.inner.has_work()


class Collector:
    """The asyncio side: gathers updates and wakes waiters when every awaited request is done."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop_thread = threading.get_ident()
        self.tokens: dict[str, list[int]] = {}
        self.terminals: dict[str, Terminal] = {}
        self.wrong_thread = 0
        self._waiting: set[str] = set()
        self._done = asyncio.Event()

    def on_outputs(self, outputs: StepOutputs) -> None:
        if threading.get_ident() != self.loop_thread:
            self.wrong_thread += 1
        for u in outputs.updates:
            assert u.request_id not in self.terminals
            self.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.terminal is not None:
                self.terminals[u.request_id] = u.terminal
        if self._waiting <= set(self.terminals):
            self._done.set()

    async def wait_for(self, ids: Sequence[str], timeout: float = 10.0) -> None:
        self._waiting = set(ids)
        self._done.clear()
        if self._waiting <= set(self.terminals):
            return
        await asyncio.wait_for(self._done.wait(), timeout)


def _requests(prefix: str, n: int, max_tokens: int = 12) -> list[Request]:
    return [
        Request(
            f"{prefix}{i}",
            tuple(f"{prefix} prompt {i} ".encode()),
            SamplingParams(max_tokens=max_tokens, seed=i),
        )
        for i in range(n)
    ]


def _expect(collector: Collector, requests: Sequence[Request]) -> None:
    for r in requests:
        done = sim_completion(r.prompt_token_ids, r.sampling)
        assert collector.tokens[r.request_id] == list(done.token_ids)
        assert isinstance(collector.terminals[r.request_id], Finished)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_driver_serves_hands_outputs_to_the_loop_and_blocks_when_idle(async_scheduling: bool) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        model = build_sim(SimOptions(engine=EngineConfig(max_num_seqs=4, async_scheduling=async_scheduling)))
        counting = CountingScheduler(model.scheduler)
        collector = Collector(loop)
        driver = Driver(counting, loop, collector.on_outputs)
        driver.start()
        first = _requests("a", 10)
        for r in first:
            driver.submit(r)
        await collector.wait_for([r.request_id for r in first])
        _expect(collector, first)
        assert collector.wrong_thread == 0
        # Idle: the thread blocks on its inbox, so nothing is polled while nothing arrives.
        await asyncio.sleep(0.05)
        steps, polls = counting.step_calls, counting.has_work_calls
        await asyncio.sleep(0.3)
        assert (counting.step_calls, counting.has_work_calls) == (steps, polls)
        assert driver.steps == steps
        assert driver.load.running == 0 and driver.load.waiting == 0 and driver.load.kv_pages_used == 0
        # A new submit wakes it.
        second = _requests("b", 3)
        for r in second:
            driver.submit(r)
        await collector.wait_for([r.request_id for r in second])
        _expect(collector, second)
        assert counting.step_calls > steps
        assert driver.healthy
        driver.shutdown()
        assert not driver.healthy  # the thread has ended

    asyncio.run(scenario())


def test_a_failing_step_fails_its_batch_and_the_next_requests_succeed() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        def fault(batch: StepBatch) -> None:
            if any(row.request_id == "bad" for row in batch.rows):
                raise RuntimeError("injected fault")

        model = build_sim(fault=fault)
        collector = Collector(loop)
        driver = Driver(model.scheduler, loop, collector.on_outputs)
        doomed = [Request("bad", (1, 2, 3)), Request("buddy", (4, 5, 6))]
        for r in doomed:  # queued before the thread starts: one inbox drain, one batch
            driver.submit(r)
        driver.start()
        await collector.wait_for(["bad", "buddy"])
        for rid in ("bad", "buddy"):
            terminal = collector.terminals[rid]
            assert isinstance(terminal, Failed) and "injected fault" in terminal.message
        after = _requests("ok", 5)
        for r in after:
            driver.submit(r)
        await collector.wait_for([r.request_id for r in after])
        _expect(collector, after)
        assert driver.failed_steps == 1 and driver.healthy
        assert driver.load.kv_pages_used == 0
        driver.shutdown()

    asyncio.run(scenario())


class _Unrecoverable:
    """A scheduler whose step fails and whose recovery fails too."""

    def __init__(self) -> None:
        self._pending = False

    def submit(self, request: Request) -> None:
        self._pending = True

    def abort(self, request_id: str) -> None:
        self._pending = False

    def step(self) -> StepOutputs:
        raise RuntimeError("device lost")

    def fail_step(self, message: str) -> StepOutputs:
        raise RuntimeError("cannot recover: " + message)

    def load(self) -> Load:
        return Load(0, int(self._pending), 0, 1)

    def has_work(self) -> bool:
        return self._pending


def test_a_fatal_error_marks_the_driver_unhealthy() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        fatal: list[str] = []
        got_fatal = asyncio.Event()

        def on_fatal(message: str) -> None:
            fatal.append(message)
            got_fatal.set()

        driver = Driver(_Unrecoverable(), loop, lambda _: None, on_fatal=on_fatal)
        driver.start()
        assert driver.healthy
        driver.submit(Request("x", (1,)))
        await asyncio.wait_for(got_fatal.wait(), 5.0)
        assert not driver.healthy
        assert driver.fatal_error is not None and "cannot recover" in driver.fatal_error
        assert "cannot recover" in fatal[0]
        deadline = time.monotonic() + 2
        while driver._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not driver._thread.is_alive()

    asyncio.run(scenario())


class _LostRank(_Unrecoverable):
    """A scheduler whose step raises an `EngineFatalError` (a rank gone) and recovers its batch."""

    def step(self) -> StepOutputs:
        raise EngineFatalError("rank 1 is gone")

    def fail_step(self, message: str) -> StepOutputs:
        self._pending = False
        return StepOutputs((RequestUpdate("x", terminal=Failed(message)),))


def test_an_engine_fatal_step_fails_its_batch_then_marks_the_driver_unhealthy() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        outputs: list[StepOutputs] = []
        got_fatal = asyncio.Event()
        driver = Driver(_LostRank(), loop, outputs.append, on_fatal=lambda _: got_fatal.set())
        driver.start()
        driver.submit(Request("x", (1,)))
        await asyncio.wait_for(got_fatal.wait(), 5.0)
        assert (
            not driver.healthy and driver.fatal_error is not None and "rank 1 is gone" in driver.fatal_error
        )
        await asyncio.sleep(0)
        (failed,) = [u for o in outputs for u in o.updates]
        assert isinstance(failed.terminal, Failed) and "rank 1 is gone" in failed.terminal.message

    asyncio.run(scenario())
