"""The outcome of `infer gates` as data, and its JSON and JUnit XML files.

Both files are written whatever happened: a run stopped by a manifest, membership or preflight
problem reports those problems and marks every gate `not-run`, so CI shows why nothing ran. The
JSON file is also rewritten after each gate, with status `incomplete`, so a run killed part-way
leaves its findings.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from gates.runner.execution import GateOutcome
from gates.runner.manifest import Gate
from gates.runner.needs import Tier
from gates.runner.problems import Problem

Mode = Literal["run", "check"]


@dataclass(slots=True, frozen=True)
class GateRow:
    gate: Gate
    base_needs: tuple[str, ...]
    selected: bool
    outcome: GateOutcome | None

    @property
    def result(self) -> str:
        if self.outcome is not None:
            return self.outcome.result
        return "not-run" if self.selected else "not-selected"


@dataclass(slots=True, frozen=True)
class RunReport:
    suite: str
    manifest: Path
    mode: Mode
    tier: Tier
    checkpoint: Path | None
    problems: tuple[Problem, ...]
    rows: tuple[GateRow, ...]
    started: datetime
    # The gates `--gate` picked (empty: the whole tier).
    only: tuple[str, ...] = ()
    shared_process: bool = False
    # `--tensor-parallel-size`: the ranks every gate's engines ran at.
    tensor_parallel_size: int = 1
    # The decode-path knobs every gate's engines ran with, by name (empty: the defaults).
    decode_path: Mapping[str, Any] = field(default_factory=dict)
    # False for the report written after each gate while the run goes on: a run whose process is
    # killed (a lent machine taken back) still leaves what its finished gates found.
    finished: bool = True

    @property
    def ran(self) -> list[GateOutcome]:
        return [row.outcome for row in self.rows if row.outcome is not None]

    @property
    def status(self) -> str:
        if self.problems:
            return f"{self.problems[0].stage}-failed"
        if not self.finished:
            return "incomplete"
        if self.mode == "check":
            return "checked"
        if not any(row.selected for row in self.rows):
            return "nothing-selected"
        return "passed" if all(outcome.passed for outcome in self.ran) else "failed"

    @property
    def ok(self) -> bool:
        return self.status in ("checked", "nothing-selected", "passed")


def to_json(report: RunReport) -> dict[str, Any]:
    return {
        "suite": report.suite,
        "manifest": str(report.manifest),
        "mode": report.mode,
        "tier": report.tier,
        "only": list(report.only),
        "shared_process": report.shared_process,
        "tensor_parallel_size": report.tensor_parallel_size,
        "decode_path": dict(report.decode_path),
        "checkpoint": str(report.checkpoint) if report.checkpoint is not None else None,
        "started": report.started.isoformat(),
        "status": report.status,
        "ok": report.ok,
        "problems": [{"stage": p.stage, "subject": p.subject, "message": p.message} for p in report.problems],
        "gates": [
            {
                "id": row.gate.id,
                "test": row.gate.test,
                "invariant": row.gate.invariant,
                "needs": list(row.gate.needs),
                "base_needs": list(row.base_needs),
                "selected": row.selected,
                "result": row.result,
                "seconds": round(row.outcome.seconds, 3) if row.outcome else None,
                "message": row.outcome.message if row.outcome else "",
                # Kept for passing gates too: what they print is what their bounds were calibrated from.
                "output_tail": row.outcome.output_tail if row.outcome else "",
            }
            for row in report.rows
        ],
    }


def write_json(report: RunReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(report), indent=2) + "\n")


def _testcase(parent: ET.Element, suite: str, name: str, seconds: float) -> ET.Element:
    return ET.SubElement(parent, "testcase", classname=suite, name=name, time=f"{seconds:.3f}")


def to_junit(report: RunReport) -> ET.Element:
    root = ET.Element("testsuites", name="infer gates")
    suite = ET.SubElement(root, "testsuite", name=report.suite, timestamp=report.started.isoformat())
    failures = skipped = 0
    total_seconds = 0.0
    for problem in report.problems:
        case = _testcase(suite, report.suite, f"{problem.stage}: {problem.subject}", 0.0)
        ET.SubElement(case, "failure", message=problem.message, type=problem.stage).text = str(problem)
        failures += 1
    for row in report.rows:
        seconds = row.outcome.seconds if row.outcome else 0.0
        total_seconds += seconds
        case = _testcase(suite, report.suite, row.gate.id, seconds)
        if row.outcome is None:
            if row.selected:
                why = (
                    "not run: the run stopped before execution"
                    if report.problems
                    else "checked, not run (--check)"
                )
            else:
                why = f"not selected at tier {report.tier}: needs {', '.join(row.base_needs) or 'nothing'}"
            ET.SubElement(case, "skipped", message=why)
            skipped += 1
        elif not row.outcome.passed:
            failure = ET.SubElement(case, "failure", message=row.outcome.message, type=row.outcome.result)
            failure.text = row.outcome.output_tail
            failures += 1
    count = len(report.problems) + len(report.rows)
    for element in (root, suite):
        element.set("tests", str(count))
        element.set("failures", str(failures))
        element.set("errors", "0")
        element.set("skipped", str(skipped))
        element.set("time", f"{total_seconds:.3f}")
    return root


def write_junit(report: RunReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tree = ET.ElementTree(to_junit(report))
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)


def now() -> datetime:
    return datetime.now(UTC)
