"""Start pytest in a child process the way the runner needs it, and read back what it recorded.

Every child runs `python -m pytest` from the suite root with the root as rootdir (so node ids
are the manifest's), no cache writes, and the runner's plugin (plugin_path/) on PYTHONPATH. Its
process group is killed on timeout, and when the runner itself is stopped (an exception, Ctrl-C, or
SIGTERM turned into SystemExit by the CLI), so neither a hung gate nor a stopped run leaves a child
holding the GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLUGIN_DIR = Path(__file__).resolve().parent / "plugin_path"
PLUGIN = "infer_gate_plugin"
REPORT_OUT = "INFER_GATE_REPORT_OUT"
PROGRESS_OUT = "INFER_GATE_PROGRESS_OUT"
OUTPUT_TAIL_CHARS = 6000


@dataclass(slots=True, frozen=True)
class PytestRun:
    returncode: int | None  # None: killed at the timeout
    seconds: float
    output: str
    # What the plugin recorded; None if pytest died before writing it.
    report: Mapping[str, Any] | None

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def output_tail(self) -> str:
        return self.output[-OUTPUT_TAIL_CHARS:]


def _env(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(PLUGIN_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def pytest_command(root: Path, args: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        PLUGIN,
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(root),
        *args,
    ]


def start_pytest(
    root: Path, args: Sequence[str], env: Mapping[str, str], output: Path
) -> subprocess.Popen[str]:
    """A child pytest in its own session writing its terminal output to `output`; the caller
    stops it with `kill_group`."""
    with output.open("w") as sink:
        return subprocess.Popen(
            pytest_command(root, args),
            cwd=root,
            env=_env(env),
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def kill_group(process: subprocess.Popen[str]) -> None:
    """Kill the child and everything it started (it has its own session: nothing else would)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_pytest(
    root: Path, args: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None
) -> PytestRun:
    with tempfile.TemporaryDirectory(prefix="infer-gates-") as scratch:
        report_path = Path(scratch) / "report.json"
        started = time.monotonic()
        process = subprocess.Popen(
            pytest_command(root, args),
            cwd=root,
            env=_env({REPORT_OUT: str(report_path), **(env or {})}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        returncode: int | None
        try:
            output, _ = process.communicate(timeout=timeout_s)
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            returncode = None
        except BaseException:
            # The child has its own session: without this it would outlive the runner.
            kill_group(process)
            raise
        seconds = time.monotonic() - started
        report: Mapping[str, Any] | None = None
        if report_path.is_file():
            try:
                report = json.loads(report_path.read_text())
            except json.JSONDecodeError:
                report = None
        return PytestRun(returncode, seconds, output or "", report)
