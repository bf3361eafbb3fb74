"""Execution: each selected gate in its own pytest process, one after another, with its timeout
(shared_process.py runs many gates in one process instead).

A process per gate means a gate that exhausts GPU memory, leaks a CUDA context or crashes the
interpreter cannot poison the next one. The checkpoint reaches the gate as INFER_TEST_CHECKPOINT,
the run's tensor-parallel size as INFER_GATE_TENSOR_PARALLEL_SIZE and its decode-path knobs as
INFER_GATE_DECODE_PATH (`gate_env`).
A gate passes only when pytest ran at least one test for it and every one of them passed; a
skip, an xfail, a timeout, a crash or an empty collection is a failure.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gates.runner.manifest import Gate, Manifest
from gates.runner.needs import DECODE_PATH_ENV, TENSOR_PARALLEL_ENV
from gates.runner.preflight import CHECKPOINT_ENV
from gates.runner.pytest_process import PytestRun, run_pytest

Result = Literal["passed", "failed", "skipped", "timeout", "error"]


@dataclass(slots=True, frozen=True)
class GateOutcome:
    gate: Gate
    result: Result
    seconds: float
    message: str
    output_tail: str

    @property
    def passed(self) -> bool:
        return self.result == "passed"


def judge_tests(gate: Gate, tests: Sequence[Mapping[str, Any]]) -> tuple[Result, str]:
    """The verdict from the plugin's per-test records of one gate (its test and parametrizations)."""
    if not tests:
        return "error", f"pytest ran no test for {gate.test}"
    for outcome in ("failed", "skipped"):
        bad = [t for t in tests if t["outcome"] == outcome]
        if bad:
            first = bad[0]
            verdict: Result = "failed" if outcome == "failed" else "skipped"
            if len(tests) == 1:
                return verdict, first["message"]
            return (
                verdict,
                f"{len(bad)} of {len(tests)} tests {outcome}; first {first['nodeid']}: {first['message']}",
            )
    return "passed", ""


def judge(gate: Gate, run: PytestRun) -> tuple[Result, str]:
    if run.timed_out:
        return "timeout", f"ran past its timeout of {gate.timeout_s}s and was killed"
    if run.report is None:
        return "error", f"pytest exited {run.returncode} before reporting (crash or startup error)"
    errors = run.report.get("collect_errors", [])
    if errors:
        return "error", f"did not collect: {errors[0]['message']}"
    tests = run.report.get("tests", [])
    if not tests:
        return "error", f"pytest ran no test for {gate.test} (exit {run.returncode})"
    result, message = judge_tests(gate, tests)
    if result == "passed" and run.returncode != 0:
        return "failed", f"every test passed but pytest exited {run.returncode}"
    return result, message


def gate_env(
    checkpoint: Path | None, tensor_parallel_size: int = 1, decode_path: Mapping[str, object] | None = None
) -> dict[str, str]:
    """What a gate's process is told of the run, in its environment."""
    env = {TENSOR_PARALLEL_ENV: str(tensor_parallel_size)}
    if decode_path:
        env[DECODE_PATH_ENV] = json.dumps(dict(decode_path), sort_keys=True)
    if checkpoint is not None:
        env[CHECKPOINT_ENV] = str(checkpoint)
    return env


def run_gate(manifest: Manifest, gate: Gate, env: Mapping[str, str]) -> GateOutcome:
    run = run_pytest(manifest.suite.root, ["-q", "-rA", gate.test], gate.timeout_s, env)
    result, message = judge(gate, run)
    return GateOutcome(gate, result, run.seconds, message, run.output_tail)


def run_gates(
    manifest: Manifest,
    gates: Sequence[Gate],
    env: Mapping[str, str],
    on_start: Callable[[Gate], None],
    on_done: Callable[[GateOutcome], None],
) -> list[GateOutcome]:
    """`env`: `gate_env`'s, for every gate's process."""
    outcomes: list[GateOutcome] = []
    for gate in gates:
        on_start(gate)
        outcome = run_gate(manifest, gate, env)
        outcomes.append(outcome)
        on_done(outcome)
    return outcomes
