"""One step contract across ranks: rank 0's runner hands every step to every rank.

The scheduler, the driver and the ledger stay on rank 0 and see one `ModelRunner`. Before each
forward, `TensorParallelRunner` checks the workers are alive and publishes the step's batch (its
rows without their host-only history) on the group's store; every rank then packs the same rows
and runs the same forward, whose collectives keep the ranks in step, and rank 0 alone samples.
Pages and state slots are rank 0's bookkeeping: a page id means the same slot in every rank's
pool, so what rank 0 frees is free on every rank.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from engine.model_runner import PagedModelRunner
from engine.runner import SampledToken, StepBatch

# How often an idle worker looks up from its wait for the next step to check that rank 0 lives.
_IDLE_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class StepMessage:
    batch: StepBatch


@dataclass(frozen=True, slots=True)
class ScoreMessage:
    token_ids: tuple[int, ...]
    page_table: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StopMessage:
    pass


Message = StepMessage | ScoreMessage | StopMessage


def _step_key(index: int) -> str:
    return f"step/{index}"


class StepChannel:
    """Rank 0's messages to the workers, in order, through the store. Message n is deleted when n+2
    is sent: by then every worker has run n+1's collectives, so it has read n."""

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._next = 0

    def send(self, message: Message) -> None:
        # The store holds bytes; its stub admits only str.
        self._store.set(_step_key(self._next), pickle.dumps(message))  # type: ignore[arg-type]
        if self._next >= 2:
            self._store.delete_key(_step_key(self._next - 2))
        self._next += 1

    def receive(self, parent_pid: int) -> Message:
        """The next message; a `StopMessage` once rank 0's process is gone."""
        key = _step_key(self._next)
        while True:
            try:
                self._store.wait([key], timedelta(seconds=_IDLE_POLL_S))
                break
            except dist.DistStoreError:
                if os.getppid() != parent_pid:
                    return StopMessage()
        self._next += 1
        message = pickle.loads(self._store.get(key))
        assert isinstance(message, StepMessage | ScoreMessage | StopMessage)
        return message


def serve_steps(runner: PagedModelRunner, channel: StepChannel, parent_pid: int) -> None:
    """A worker's loop: run every step rank 0 publishes, until it says stop or is gone."""
    while True:
        message = channel.receive(parent_pid)
        if isinstance(message, StopMessage):
            return
        if isinstance(message, StepMessage):
            runner.forward(message.batch)
        else:
            runner.score(message.token_ids, message.page_table)


class Workers(Protocol):
    def check(self) -> None:
        """Raise, naming the rank, when a worker has exited; stop the others then."""
        ...

    def stop(self) -> None: ...


class TensorParallelRunner:
    """Rank 0's `ModelRunner`: every forward is announced to the workers, then run here too."""

    def __init__(self, local: PagedModelRunner, channel: StepChannel, workers: Workers) -> None:
        self.local = local
        self._channel = channel
        self._workers = workers
        self._closed = False

    @property
    def model(self) -> object:
        return self.local.model

    def _announce(self, message: Message) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel runner is closed")
        self._workers.check()
        self._channel.send(message)

    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        # The rows' history stays here: no worker samples, and none reads it.
        rows = tuple(replace(row, context=()) for row in batch.rows)
        self._announce(StepMessage(replace(batch, rows=rows)))
        return self.local.execute(batch)

    def score(self, token_ids: Sequence[int], page_table: Sequence[int]) -> torch.Tensor:
        """`PagedModelRunner.score` on every rank; the logits are rank 0's."""
        self._announce(ScoreMessage(tuple(token_ids), tuple(page_table)))
        return self.local.score(token_ids, page_table)

    def close(self) -> None:
        """Tell the workers to stop and wait for them (bounded); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._channel.send(StopMessage())
        finally:
            self._workers.stop()
