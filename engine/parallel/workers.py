"""The worker processes of a tensor-parallel engine: started, watched and stopped by rank 0.

Ranks 1..N-1 are spawned processes (a fresh interpreter each: no forked threads or allocator
state). Each joins the store rank 0 serves, builds its shard through the `build` callable the
model loader hands in (a picklable function of rank and group), then serves the steps rank 0
publishes (engine.parallel.runner). A worker that raises leaves in the store what it was doing
(starting: loading its shard and joining the group; or serving steps), a one-line cause and its
traceback, then exits; `check` turns an exited worker into a `WorkerDiedError` whose message is one
line naming its rank, exit code, phase and cause (the traceback goes to the log, never to a
client), and stops the rest. A worker whose rank 0 is gone stops by itself. On CUDA, rank r runs
on `cuda:r` and the group is NCCL (engine.parallel.group).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection

import torch.distributed as dist

from engine.contract import EngineFatalError, one_line
from engine.model_runner import PagedModelRunner
from engine.parallel.group import ProcessRankGroup, RankGroup, rank_device
from engine.parallel.runner import StepChannel, serve_steps

log = logging.getLogger("infer.parallel")

RankBuilder = Callable[[RankGroup], PagedModelRunner]

_HOST = "127.0.0.1"
# Seconds `stop` waits for a worker to leave before it is killed.
_STOP_WAIT_S = 5.0
# The longest traceback a worker leaves behind.
_ERROR_CHARS = 4000


class WorkerDiedError(EngineFatalError):
    """A tensor-parallel worker exited. The message is one line: its rank, exit code and, when it
    raised, what it was doing and the exception's first line; `traceback` keeps the rest."""

    def __init__(
        self, rank: int, exitcode: int | None, cause: str | None = None, traceback: str | None = None
    ) -> None:
        why = f": {cause}" if cause else ""
        super().__init__(f"tensor-parallel worker rank {rank} exited with code {exitcode}{why}")
        self.rank = rank
        self.exitcode = exitcode
        self.cause = cause
        self.traceback = traceback


def _cause_key(rank: int) -> str:
    return f"cause/{rank}"


def _traceback_key(rank: int) -> str:
    return f"traceback/{rank}"


def _worker_main(
    rank: int,
    size: int,
    port: int,
    timeout_s: float,
    device_type: str,
    build: RankBuilder,
    pipe: Connection,
) -> None:
    store = dist.TCPStore(_HOST, port, size, False, timeout=timedelta(seconds=timeout_s))
    phase = "while starting"
    try:
        runner = build(ProcessRankGroup(store, rank, size, timeout_s, device=rank_device(device_type, rank)))
        phase = "while serving steps"
        serve_steps(runner, pipe)
    except BaseException as exc:
        store.set(_traceback_key(rank), traceback.format_exc()[-_ERROR_CHARS:])
        store.set(_cause_key(rank), f"{phase}: {one_line(exc)}")
        raise SystemExit(1) from None


class WorkerPool:
    """Ranks 1..size-1 of one engine, and the store every rank meets at (served from here)."""

    def __init__(self, size: int, build: RankBuilder, timeout_s: float, device_type: str = "cpu") -> None:
        if size < 2:
            raise ValueError(f"a worker pool needs at least 2 ranks, got {size}")
        self.size = size
        self.timeout_s = timeout_s
        self.device_type = device_type
        self.store = dist.TCPStore(
            _HOST, 0, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, size)]
        self._processes = [
            context.Process(
                target=_worker_main,
                args=(rank, size, self.store.port, timeout_s, device_type, build, reader),
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

    def group(self) -> ProcessRankGroup:
        """Rank 0's membership, checking the workers' processes while it waits for them to join."""
        return ProcessRankGroup(
            self.store,
            0,
            self.size,
            self.timeout_s,
            peers_alive=self.check,
            device=rank_device(self.device_type, 0),
        )

    def pids(self) -> list[int | None]:
        return [process.pid for process in self._processes]

    def check(self, grace_s: float = 0.0) -> None:
        deadline = time.monotonic() + grace_s
        for rank, process in enumerate(self._processes, start=1):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                continue
            cause = self._reported(_cause_key(rank))
            trace = self._reported(_traceback_key(rank))
            exitcode = process.exitcode
            self.kill()
            if trace is not None:
                log.error("tensor-parallel worker rank %d failed:\n%s", rank, trace)
            raise WorkerDiedError(rank, exitcode, cause, trace)

    def _reported(self, key: str) -> str | None:
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode(errors="replace")

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
