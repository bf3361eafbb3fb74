"""Worker rank starts that fail where a real one can: reading its slice of the weights, or in a
step's forward. The tests put one in place of `models.paged_line._start_rank`; it runs in the
spawned worker, so what it is told comes through the environment the worker inherits."""

from __future__ import annotations

import os
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


def start_rank_failing_slice_read(
    line: paged_line.PagedLine,
    spec: str,
    options: ModelOptions,
    group: RankGroup,  # type: ignore[type-arg]
) -> PagedModelRunner:
    (Path(os.environ[PIDS_ENV]) / f"rank{group.rank}").write_text(str(os.getpid()))
    if group.rank == int(os.environ[FAILING_RANK_ENV]):
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
