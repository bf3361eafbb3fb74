"""Fixtures for the gate runner's tests: a throwaway suite per test and an in-process CLI."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from throwaway_suite import ThrowawaySuite
from typer.testing import CliRunner

from infer_cli.main import app


@pytest.fixture
def suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ThrowawaySuite:
    # Gates must not see a checkpoint from the environment unless a test passes one.
    monkeypatch.delenv("INFER_TEST_CHECKPOINT", raising=False)
    return ThrowawaySuite(root=tmp_path / "repo")


CliResult = tuple[int, str]


@pytest.fixture
def infer_gates() -> Callable[..., CliResult]:
    """Run `infer gates ARGS...` in process; returns (exit code, output)."""
    runner = CliRunner()

    def run(*args: str) -> CliResult:
        result = runner.invoke(app, ["gates", *args], env={"COLUMNS": "200"})
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result.exit_code, result.output

    return run
