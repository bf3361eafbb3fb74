"""Execution with `--shared-process`: the selected gates run in one pytest process, not one each.

Why: on a real-size checkpoint most of a gate's time is its process start — the interpreter,
CUDA, reading 24 GB of weights, building transformers' reference — and within one process the
checkpoint is read once and session fixtures (the transformers models) are built once.

What still holds, as in the per-gate mode:
- each gate has its own timeout, counted from its first test's start (the time before any test,
  imports and collection, counts against the first gate); a gate past it is killed with its
  process, and the gates after it go on in a new one;
- a gate that fails ends its process too, so whatever it left on the device cannot touch the
  gates after it; a crash fails the gate that was running;
- gates marked `isolated` in the manifest (they measure the device) still get a process each,
  first, on a device no other gate has touched;
- gates that need transformers (`hf-reference`) run after the others, so its models, which live
  for the rest of the process, do not sit beside every other gate's engines.
Each gate is judged the moment its last test ends, from the plugin's progress file.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gates.runner.execution import GateOutcome, Result, judge_tests, run_gates
from gates.runner.manifest import Gate, Manifest
from gates.runner.needs import HF_REFERENCE
from gates.runner.pytest_process import OUTPUT_TAIL_CHARS, PROGRESS_OUT, kill_group, start_pytest

POLL_S = 0.1


def owns(gate: Gate, nodeid: str) -> bool:
    """Whether a collected test belongs to the gate: its node, or one of its parametrizations."""
    return nodeid == gate.test or nodeid.startswith(gate.test + "[")


def shared_order(manifest: Manifest, gates: Sequence[Gate]) -> list[Gate]:
    """The gates that share a process, those needing transformers last; otherwise manifest order."""
    shared = [gate for gate in gates if not gate.isolated]
    return sorted(shared, key=lambda gate: HF_REFERENCE in manifest.base_needs(gate))


def run_gates_shared(
    manifest: Manifest,
    gates: Sequence[Gate],
    env: Mapping[str, str],
    on_start: Callable[[Gate], None],
    on_done: Callable[[GateOutcome], None],
) -> list[GateOutcome]:
    """Outcomes in the order of `gates`; `env` is execution.gate_env's."""
    isolated = run_gates(manifest, [gate for gate in gates if gate.isolated], env, on_start, on_done)
    outcomes = {outcome.gate.id: outcome for outcome in isolated}
    pending = shared_order(manifest, gates)
    while pending:
        finished = _one_process(manifest, pending, env, on_start, on_done)
        outcomes.update(finished)
        pending = [gate for gate in pending if gate.id not in finished]
    return [outcomes[gate.id] for gate in gates]


@dataclass(slots=True)
class _Follow:
    """What one shared process has done so far, rebuilt from its progress events."""

    gates: Sequence[Gate]
    started: float
    items: dict[str, list[str]] | None = None  # gate id -> its collected tests
    tests: dict[str, list[Mapping[str, Any]]] = field(default_factory=dict)
    collect_errors: list[Mapping[str, str]] = field(default_factory=list)
    current: Gate | None = None
    current_since: float = 0.0
    finished: dict[str, GateOutcome] = field(default_factory=dict)

    def owner(self, nodeid: str) -> Gate | None:
        return next((gate for gate in self.gates if owns(gate, nodeid)), None)

    def unfinished(self) -> list[Gate]:
        return [gate for gate in self.gates if gate.id not in self.finished]

    def running(self) -> tuple[Gate, float]:
        """The gate the process is in and since when; before any test starts, the first unjudged
        gate, since the process started (imports and collection count against it)."""
        if self.current is not None:
            return self.current, self.current_since
        return self.unfinished()[0], self.started

    def apply(self, event: Mapping[str, Any], now: float) -> Iterator[Gate | GateOutcome]:
        """Update from one event; yields a gate as it starts and its outcome as it ends."""
        kind = event.get("event")
        if kind == "collected":
            self.collect_errors = list(event.get("collect_errors", []))
            self.items = {
                gate.id: [n for n in event.get("items", []) if owns(gate, n)] for gate in self.gates
            }
            for gate in self.gates:
                if not self.items[gate.id]:
                    yield self.finish(gate, *self._uncollected(gate), seconds=0.0, output="")
            return
        owner = self.owner(str(event.get("nodeid")))
        if owner is None or owner.id in self.finished:
            return
        if kind == "start" and owner is not self.current:
            self.current, self.current_since = owner, now
            yield owner
        elif kind == "done":
            records = self.tests.setdefault(owner.id, [])
            records.append(event)
            if len(records) >= len((self.items or {}).get(owner.id, [])):
                result, message = judge_tests(owner, records)
                output = "".join(str(r.get("output", "")) for r in records)
                seconds = sum(float(r.get("seconds", 0.0)) for r in records)
                yield self.finish(owner, result, message, seconds, output)

    def _uncollected(self, gate: Gate) -> tuple[Result, str]:
        path = gate.test.split("::", 1)[0]
        for error in self.collect_errors:
            if error["nodeid"] and path.startswith(error["nodeid"]):
                return "error", f"did not collect: {error['message']}"
        return "error", f"pytest ran no test for {gate.test}"

    def finish(self, gate: Gate, result: Result, message: str, seconds: float, output: str) -> GateOutcome:
        outcome = GateOutcome(gate, result, seconds, message, output[-OUTPUT_TAIL_CHARS:])
        self.finished[gate.id] = outcome
        if self.current is gate:
            self.current = None
        return outcome


def _events(path: Path, offset: int) -> tuple[list[Mapping[str, Any]], int]:
    """Whole lines appended since `offset` (a line still being written waits for the next poll)."""
    if not path.is_file():
        return [], offset
    with path.open("rb") as stream:
        stream.seek(offset)
        chunk = stream.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]
    events = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
    return events, offset + len(complete)


def _one_process(
    manifest: Manifest,
    gates: Sequence[Gate],
    env: Mapping[str, str],
    on_start: Callable[[Gate], None],
    on_done: Callable[[GateOutcome], None],
) -> dict[str, GateOutcome]:
    """Run `gates` in one pytest process until they are all judged, one times out or fails, or the
    process dies; returns the gates it judged (at least one, so the caller's loop ends)."""
    with tempfile.TemporaryDirectory(prefix="infer-gates-shared-") as scratch:
        progress, log = Path(scratch) / "progress.jsonl", Path(scratch) / "pytest.log"
        # -x: a failed gate ends the process; the rest go on in a new one.
        args = ["-q", "-rA", "-x", "--continue-on-collection-errors", *(gate.test for gate in gates)]
        process = start_pytest(manifest.suite.root, args, {**env, PROGRESS_OUT: str(progress)}, log)
        follow = _Follow(gates, started=time.monotonic())
        offset = 0
        try:
            while True:
                exited = process.poll() is not None
                events, offset = _events(progress, offset)
                stop = False
                for event in events:
                    for value in follow.apply(event, time.monotonic()):
                        if isinstance(value, GateOutcome):
                            on_done(value)
                            stop = stop or not value.passed
                        else:
                            on_start(value)
                if stop or exited or not follow.unfinished():
                    break
                running, since = follow.running()
                if time.monotonic() - since > running.timeout_s:
                    if follow.current is None:
                        on_start(running)
                    kill_group(process)
                    message = f"ran past its timeout of {running.timeout_s}s and was killed"
                    on_done(follow.finish(running, "timeout", message, time.monotonic() - since, _tail(log)))
                    break
                time.sleep(POLL_S)
        finally:
            if process.poll() is None:
                kill_group(process)
        if not follow.finished or follow.current is not None:
            # The process ended inside a gate (or before any): a failure among the tests it ran
            # (-x stops at the first), else a crash.
            announced = follow.current is not None  # on_start already called for it
            gate, since = follow.running()
            if not announced:
                on_start(gate)
            records = follow.tests.get(gate.id, [])
            result, message = judge_tests(gate, records) if records else ("error", "")
            if result == "passed" or not records:
                result = "error"
                message = f"the shared pytest process exited {process.returncode} during this gate (crash?)"
            else:
                expected = len((follow.items or {}).get(gate.id, []))
                message += f" ({len(records)} of its {expected} tests ran: a failure stops the process)"
            on_done(follow.finish(gate, result, message, time.monotonic() - since, _tail(log)))
        return follow.finished


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-OUTPUT_TAIL_CHARS:] if log.is_file() else ""
