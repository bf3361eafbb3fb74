"""The worker processes of a tensor-parallel engine: started, watched and stopped by rank 0.

Ranks 1..N-1 are spawned processes (a fresh interpreter each: no forked threads or allocator
state). Each joins the store rank 0 serves, builds its shard through the `build` callable the
model loader hands in (a picklable function of rank and group), then serves the steps rank 0
publishes (engine.parallel.runner). A worker that raises leaves its traceback in the store and
exits; `check` turns an exited worker into a `WorkerDiedError` naming its rank, exit code and that
traceback, and stops the rest. A worker whose rank 0 is gone stops by itself.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection

import torch.distributed as dist

from engine.contract import EngineFatalError
from engine.model_runner import PagedModelRunner
from engine.parallel.group import GlooGroup, RankGroup
from engine.parallel.runner import StepChannel, serve_steps

RankBuilder = Callable[[RankGroup], PagedModelRunner]

_HOST = "127.0.0.1"
# Seconds `stop` waits for a worker to leave before it is killed.
_STOP_WAIT_S = 5.0
# The longest traceback a worker leaves behind.
_ERROR_CHARS = 4000


class WorkerDiedError(EngineFatalError):
    """A tensor-parallel worker exited; carries its rank, exit code and what it reported."""

    def __init__(self, rank: int, exitcode: int | None, reported: str | None) -> None:
        why = f"; it reported:\n{reported}" if reported else ""
        super().__init__(f"tensor-parallel worker rank {rank} exited with code {exitcode}{why}")
        self.rank = rank
        self.exitcode = exitcode
        self.reported = reported


def _error_key(rank: int) -> str:
    return f"error/{rank}"


def _worker_main(
    rank: int, size: int, port: int, timeout_s: float, build: RankBuilder, pipe: Connection
) -> None:
    store = dist.TCPStore(_HOST, port, size, False, timeout=timedelta(seconds=timeout_s))
    try:
        runner = build(GlooGroup(store, rank, size, timeout_s))
        serve_steps(runner, pipe)
    except BaseException:
        store.set(_error_key(rank), traceback.format_exc()[-_ERROR_CHARS:])
        raise SystemExit(1) from None


class WorkerPool:
    """Ranks 1..size-1 of one engine, and the store every rank meets at (served from here)."""

    def __init__(self, size: int, build: RankBuilder, timeout_s: float) -> None:
        if size < 2:
            raise ValueError(f"a worker pool needs at least 2 ranks, got {size}")
        self.size = size
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(
            _HOST, 0, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, size)]
        self._processes = [
            context.Process(
                target=_worker_main,
                args=(rank, size, self.store.port, timeout_s, build, reader),
                name=f"infer-tp-rank{rank}",
                daemon=True,
            )
            for rank, (reader, _) in enumerate(pipes, start=1)
        ]
        for process in self._processes:
            process.start()
        # Rank 0 keeps only the writing ends: a worker reads their closing as rank 0's end.
        for reader, _ in pipes:
            reader.close()
        self.channel = StepChannel([writer for _, writer in pipes])

    def group(self) -> GlooGroup:
        """Rank 0's membership, checking the workers' processes while it waits for them to join."""
        return GlooGroup(self.store, 0, self.size, self.timeout_s, peers_alive=self.check)

    def pids(self) -> list[int | None]:
        return [process.pid for process in self._processes]

    def check(self, grace_s: float = 0.0) -> None:
        deadline = time.monotonic() + grace_s
        for rank, process in enumerate(self._processes, start=1):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                continue
            reported = None
            if self.store.check([_error_key(rank)]):
                reported = self.store.get(_error_key(rank)).decode(errors="replace")
            exitcode = process.exitcode
            self.kill()
            raise WorkerDiedError(rank, exitcode, reported)

    def stop(self) -> None:
        """Wait (bounded) for workers told to stop, then kill any still there."""
        self.channel.close()
        for process in self._processes:
            process.join(_STOP_WAIT_S if process.is_alive() else 0)
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(_STOP_WAIT_S)

    def kill(self) -> None:
        """Stop every worker now: what a failed rank leaves behind can only hang."""
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(_STOP_WAIT_S)
