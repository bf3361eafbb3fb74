"""gates/conftest.py: its fixtures fail (never skip) without what they stand for, and a gate that
skips itself under plain pytest is failed too. Each case runs pytest in a child process with the
shared conftest loaded as a plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_gate_module(tmp_path: Path, source: str, env: dict[str, str]) -> dict[str, str]:
    """Outcome per test name of a gate module run under gates/conftest.py."""
    module = tmp_path / "test_gate_module.py"
    module.write_text(textwrap.dedent(source))
    junit = tmp_path / "report.xml"
    child_env = {key: value for key, value in os.environ.items() if key != "INFER_TEST_CHECKPOINT"}
    child_env.update(env)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "gates.conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "--junitxml",
            str(junit),
            "-q",
            str(module),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=child_env,
        timeout=120,
    )
    outcomes: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[str(case.get("name"))] = kinds[0] if kinds else "passed"
    assert outcomes, done.stdout + done.stderr
    return outcomes


def test_checkpoint_fixtures_fail_without_a_checkpoint(tmp_path: Path) -> None:
    source = """
        def test_path(checkpoint_path):
            pass

        def test_config(checkpoint_config):
            pass
    """
    assert run_gate_module(tmp_path, source, {}) == {"test_path": "error", "test_config": "error"}
    missing = {"INFER_TEST_CHECKPOINT": str(tmp_path / "nowhere")}
    assert run_gate_module(tmp_path, source, missing) == {"test_path": "error", "test_config": "error"}


def test_checkpoint_fixtures_hand_over_the_checkpoint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    source = f"""
        from pathlib import Path

        def test_path(checkpoint_path):
            assert checkpoint_path == Path({str(checkpoint)!r})

        def test_config(checkpoint_config):
            assert checkpoint_config["hidden_size"] == 64
    """
    outcomes = run_gate_module(tmp_path, source, {"INFER_TEST_CHECKPOINT": str(checkpoint)})
    assert outcomes == {"test_path": "passed", "test_config": "passed"}


def test_cuda_device_fails_without_a_gpu(tmp_path: Path) -> None:
    source = """
        def test_on_gpu(cuda_device):
            assert cuda_device.type == "cuda"
    """
    assert run_gate_module(tmp_path, source, {"CUDA_VISIBLE_DEVICES": ""}) == {"test_on_gpu": "error"}


@pytest.mark.parametrize(
    "body",
    ['pytest.skip("not today")', 'pytest.importorskip("not_a_module_anywhere")'],
    ids=["skip", "importorskip"],
)
def test_a_skip_under_the_shared_conftest_is_a_failure(tmp_path: Path, body: str) -> None:
    source = f"""
        import pytest

        def test_gate():
            {body}
    """
    assert run_gate_module(tmp_path, source, {}) == {"test_gate": "failure"}
