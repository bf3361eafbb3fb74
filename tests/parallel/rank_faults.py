"""Worker rank starts that fail where a real one can: reading its slice of the weights, or in a
step's forward. The tests put one in place of `models.paged_line._start_rank`; it runs in the
spawned worker, so what it is told comes through the environment the worker inherits."""

from __future__ import annotations

import os
import time
from pathlib import Path

from engine.model_runner import PagedModelRunner
from engine.parallel.group import RankGroup
from engine.runner import StepBatch
from models import checkpoint, paged_line
from models.registry import ModelOptions

# The rank whose slice reads fail, and a folder where every worker writes its pid.
FAILING_RANK_ENV = "INFER_TEST_FAILING_RANK"
PIDS_ENV = "INFER_TEST_RANK_PIDS"


def _unreadable(self: checkpoint.TensorSlice, handle: object) -> object:
    raise OSError(f"slice {self} could not be read (injected)")


def _wait_for_every_worker(pids: Path, size: int, timeout_s: float = 60.0) -> None:
    """The failing rank fails once every worker (ranks 1 up) has written its pid, so the test can
    check that each one is stopped: on a loaded CPU a worker spawned last may otherwise be stopped
    before it gets here (2026-12-06: rank 1 had not started when rank 2's failure ended the group)."""
    deadline = time.monotonic() + timeout_s
    while any(not (pids / f"rank{rank}").exists() for rank in range(1, size)):
        if time.monotonic() > deadline:
            return  # the test's own check of the pids then names the worker that never started
        time.sleep(0.05)


def start_rank_failing_slice_read(
    line: paged_line.PagedLine,
    spec: str,
    options: ModelOptions,
    group: RankGroup,  # type: ignore[type-arg]
) -> PagedModelRunner:
    pids = Path(os.environ[PIDS_ENV])
    (pids / f"rank{group.rank}").write_text(str(os.getpid()))
    if group.rank == int(os.environ[FAILING_RANK_ENV]):
        _wait_for_every_worker(pids, group.size)
        checkpoint.TensorSlice.read = _unreadable  # type: ignore[method-assign, assignment]
    return paged_line._start_rank(line, spec, options, group)


def _failing_forward(self: PagedModelRunner, batch: StepBatch) -> None:
    raise RuntimeError("forward failed (injected)")


def start_rank_failing_forward(
    line: paged_line.PagedLine,
    spec: str,
    options: ModelOptions,
    group: RankGroup,  # type: ignore[type-arg]
) -> PagedModelRunner:
    """Starts as a rank does; the failing rank's every step then raises in its forward."""
    runner = paged_line._start_rank(line, spec, options, group)
    if group.rank == int(os.environ[FAILING_RANK_ENV]):
        PagedModelRunner.forward = _failing_forward  # type: ignore[method-assign, assignment]
    return runner
