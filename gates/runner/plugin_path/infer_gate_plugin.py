"""pytest plugin loaded into every pytest the gate runner starts (`-p infer_gate_plugin`).

- A gate never skips: a test that skips itself, or is marked xfail, is reported as failed, and
  so is a gate module that skips itself at import. (gates/conftest.py applies the same rule to
  plain `pytest gates/...` runs.)
- When INFER_GATE_REPORT_OUT names a file, the collected node ids, each test's outcome and the
  collection errors are written there as JSON when the session ends; the runner reads that file
  instead of parsing pytest's terminal output.
- When INFER_GATE_PROGRESS_OUT names a file, the same facts are appended to it as they happen,
  one JSON object per line (`collected`, then `start` and `done` per test, `done` carrying the
  test's outcome and captured output), so a runner following several gates in one process can
  judge each as soon as it ends.

Loaded as a top-level module from its own folder, it imports only the standard library and
pytest, so it works for a suite outside this repository too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

REPORT_OUT = "INFER_GATE_REPORT_OUT"
PROGRESS_OUT = "INFER_GATE_PROGRESS_OUT"
OUTPUT_CHARS = 6000
_ORDER = {"passed": 0, "skipped": 1, "failed": 2}


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def fail_instead_of_skip(report: pytest.TestReport | pytest.CollectReport, what: str) -> None:
    """Turn a skipped (or xfail/xpass) report into a failed one, naming why; idempotent."""
    wasxfail = getattr(report, "wasxfail", None)
    if wasxfail is not None:
        del report.wasxfail
        report.outcome = "failed"
        report.longrepr = f"{what} is marked xfail ({wasxfail or 'no reason'}): a gate must pass outright"
    elif report.skipped:
        reason = _skip_reason(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{what} skipped itself ({reason}): a gate fails instead of skipping"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    fail_instead_of_skip(report, "this gate")
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    report = yield
    fail_instead_of_skip(report, f"gate module {collector.nodeid or collector.name}")
    return report


class _Recorder:
    def __init__(self, out: Path | None, progress: Path | None) -> None:
        self.out = out
        self.progress = progress
        self.items: list[str] = []
        self.tests: dict[str, dict[str, Any]] = {}
        self.collect_errors: list[dict[str, str]] = []

    def _emit(self, event: str, **fields: Any) -> None:
        if self.progress is not None:
            with self.progress.open("a") as stream:
                stream.write(json.dumps({"event": event, **fields}) + "\n")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = [item.nodeid for item in session.items]
        self._emit("collected", items=self.items, collect_errors=self.collect_errors)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append({"nodeid": report.nodeid, "message": _tail(report.longreprtext)})

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        self._emit("start", nodeid=nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.tests.setdefault(
            report.nodeid,
            {"nodeid": report.nodeid, "outcome": "passed", "message": "", "seconds": 0.0, "output": ""},
        )
        entry["seconds"] += report.duration
        if _ORDER[report.outcome] > _ORDER[entry["outcome"]]:
            entry["outcome"] = report.outcome
            entry["message"] = _short(report)
        captured = "".join(f"--- {title}\n{content}" for title, content in report.sections)
        if report.failed:
            captured += f"--- {report.when} failed\n{report.longreprtext}\n"
        entry["output"] = (entry["output"] + captured)[-OUTPUT_CHARS:]

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        self._emit(
            "done", **self.tests.get(nodeid, {"nodeid": nodeid, "outcome": "failed", "message": "no report"})
        )

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.out is None:
            return
        body = {
            "exitstatus": int(exitstatus),
            "items": self.items,
            "tests": [{k: v for k, v in test.items() if k != "output"} for test in self.tests.values()],
            "collect_errors": self.collect_errors,
        }
        self.out.write_text(json.dumps(body))


def _short(report: pytest.TestReport) -> str:
    """The one-line reason: pytest's crash message where it has one (`assert 2 == 3`)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = str(crash.message) if crash is not None else _tail(report.longreprtext, 3)
    return message if report.when == "call" else f"in {report.when}: {message}"


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def pytest_configure(config: pytest.Config) -> None:
    out, progress = os.environ.get(REPORT_OUT), os.environ.get(PROGRESS_OUT)
    if out or progress:
        recorder = _Recorder(Path(out) if out else None, Path(progress) if progress else None)
        config.pluginmanager.register(recorder, "infer_gate_recorder")
