"""One step contract across ranks: rank 0's runner hands every step to every rank.

The scheduler, the driver and the ledger stay on rank 0 and see one `ModelRunner`. Before each
forward, `TensorParallelRunner` checks the workers are alive and sends the step's batch (its
rows without their host-only history) down a pipe to each worker; every rank then packs the same rows
and runs the same forward, whose collectives keep the ranks in step, and rank 0 alone samples.
Pages and state slots are rank 0's bookkeeping: a page id means the same slot in every rank's
pool, so what rank 0 frees is free on every rank.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Protocol

import torch

from engine.model_runner import PagedModelRunner
from engine.parallel.group import CollectiveError
from engine.runner import SampledToken, StepBatch

# How long a failed step waits for a worker whose connection broke to be seen exiting. Only a failed
# collective waits; a loaded 2-core machine (make test, 2026-12-05) once took over 1 s to see a
# raising worker exit, and the step then blamed the broken connection instead of the worker.
_EXIT_GRACE_S = 3.0


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


class StepChannel:
    """Rank 0's messages to the workers, in order: one pipe per worker. A worker blocks on its end
    until the next message, and reads the end of the pipe (rank 0 gone) as stop."""

    def __init__(self, pipes: Sequence[Connection]) -> None:
        self._pipes = list(pipes)

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.close()

    def send(self, message: Message) -> None:
        payload = pickle.dumps(message)
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send_bytes(payload)
            except OSError as exc:
                raise ConnectionError(f"tensor-parallel worker rank {rank} is gone ({exc})") from exc

    @staticmethod
    def receive(pipe: Connection) -> Message:
        try:
            message = pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):
            return StopMessage()
        assert isinstance(message, StepMessage | ScoreMessage | StopMessage)
        return message


def serve_steps(runner: PagedModelRunner, pipe: Connection) -> None:
    """A worker's loop: run every step rank 0 publishes, until it says stop or is gone."""
    while True:
        message = StepChannel.receive(pipe)
        if isinstance(message, StopMessage):
            return
        if isinstance(message, StepMessage):
            runner.forward(message.batch)
        else:
            runner.score(message.token_ids, message.page_table)


class Workers(Protocol):
    def check(self, grace_s: float = 0.0) -> None:
        """Raise, naming the rank, when a worker has exited (waiting up to `grace_s` for one to
        finish exiting); stop the others then."""
        ...

    def stop(self) -> None: ...

    def kill(self) -> None: ...

    def pids(self) -> list[int | None]: ...


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

    def worker_pids(self) -> list[int | None]:
        """The processes of ranks 1..N-1, in rank order."""
        return self._workers.pids()

    def _announce(self, message: Message) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel runner is closed")
        self._workers.check()
        # A worker killed since the check shows first as a broken pipe: name its exit instead.
        with self._blaming_dead_workers():
            self._channel.send(message)

    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        # The rows' history stays here: no worker samples, and none reads it.
        rows = tuple(replace(row, context=()) for row in batch.rows)
        self._announce(StepMessage(replace(batch, rows=rows)))
        with self._blaming_dead_workers():
            return self.local.execute(batch)

    def score(self, token_ids: Sequence[int], page_table: Sequence[int]) -> torch.Tensor:
        """`PagedModelRunner.score` on every rank; the logits are rank 0's."""
        self._announce(ScoreMessage(tuple(token_ids), tuple(page_table)))
        with self._blaming_dead_workers():
            return self.local.score(token_ids, page_table)

    @contextlib.contextmanager
    def _blaming_dead_workers(self) -> Iterator[None]:
        """A collective that fails because a worker died reads as a reset connection; the error
        raised names the worker that died instead, when one did. After a failed collective the
        ranks are out of step: the workers are stopped."""
        try:
            yield
        except Exception as exc:
            try:
                self._workers.check(grace_s=_EXIT_GRACE_S)
            except Exception as died:
                raise died from exc
            if isinstance(exc, CollectiveError):
                self._workers.kill()
            raise

    def close(self) -> None:
        """Tell the workers to stop and wait for them (bounded); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            # A worker that is already gone needs no stop message.
            with contextlib.suppress(ConnectionError):
                self._channel.send(StopMessage())
        finally:
            self._workers.stop()
