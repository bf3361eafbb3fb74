"""Preflight, execution, tiers and reports of `infer gates`, on throwaway suites."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
from throwaway_suite import ThrowawaySuite, fake_checkpoint, gate_entry

from gates.runner.execution import GateOutcome
from gates.runner.reports import GateRow, RunReport, now
from infer_cli.gates_cmd import results_table

Run = Callable[..., tuple[int, str]]


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_a_missing_checkpoint_fails_closed_before_any_gate(suite: ThrowawaySuite, infer_gates: Run) -> None:
    free = suite.marking_gate("test_a.py", "test_needs_nothing")
    parity = suite.marking_gate("test_b.py", "test_parity")
    suite.write_manifest(
        [gate_entry("demo.free", free), gate_entry("demo.parity", parity, needs=["checkpoint"])],
        model_types=["gemma4"],
    )
    code, output = infer_gates("--manifest", str(suite.manifest))
    assert code == 2
    assert "checkpoint" in output and "no checkpoint given" in output and "needed by demo.parity" in output
    assert suite.executed() == []

    code, output = infer_gates("--manifest", str(suite.manifest), "--checkpoint", str(suite.root / "nowhere"))
    assert code == 2
    assert "does not exist" in output
    assert suite.executed() == []


def test_the_checkpoint_must_parse_and_be_a_covered_model_type(
    suite: ThrowawaySuite, infer_gates: Run
) -> None:
    gate = suite.marking_gate("test_a.py", "test_parity")
    suite.write_manifest([gate_entry("demo.parity", gate, needs=["checkpoint"])], model_types=["gemma4"])

    qwen = fake_checkpoint(suite.root / "qwen", "qwen3_5", "qwen3_5_text")
    code, output = infer_gates("--manifest", str(suite.manifest), "--checkpoint", str(qwen))
    assert code == 2
    assert "qwen3_5 / qwen3_5_text checkpoint" in output and "gemma4_unified_text" in output

    broken = suite.root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    code, output = infer_gates("--manifest", str(suite.manifest), "--checkpoint", str(broken))
    assert code == 2 and "does not parse" in output
    assert suite.executed() == []

    # The 12B's outer and text types belong to the gemma4 line.
    unified = fake_checkpoint(suite.root / "unified", "gemma4_unified", "gemma4_unified_text")
    code, output = infer_gates("--manifest", str(suite.manifest), "--checkpoint", str(unified))
    assert code == 0, output
    assert suite.executed() == ["test_parity"]


def test_an_unmet_gpu_need_is_named_and_nothing_runs(
    suite: ThrowawaySuite, infer_gates: Run, no_gpu: None
) -> None:
    cpu = suite.marking_gate("test_a.py", "test_cpu")
    gpu = suite.marking_gate("test_b.py", "test_gpu")
    suite.write_manifest([gate_entry("demo.cpu", cpu), gate_entry("demo.gpu", gpu, needs=["gpu"])])
    code, output = infer_gates("--manifest", str(suite.manifest), "--tier", "all")
    assert code == 2
    assert "no CUDA device" in output and "needed by demo.gpu" in output
    assert suite.executed() == []


def test_the_checkpoint_reaches_the_gate(suite: ThrowawaySuite, infer_gates: Run, monkeypatch) -> None:
    checkpoint = fake_checkpoint(suite.root / "ckpt", "qwen3")
    expected = str(checkpoint.resolve())
    gate = suite.marking_gate(
        "test_a.py",
        "test_sees_checkpoint",
        f"import os; assert os.environ['INFER_TEST_CHECKPOINT'] == {expected!r}",
    )
    suite.write_manifest([gate_entry("demo.sees", gate, needs=["checkpoint"])], model_types=["qwen3"])
    monkeypatch.setenv("INFER_TEST_CHECKPOINT", str(checkpoint))
    code, output = infer_gates("--manifest", str(suite.manifest))
    assert code == 0, output
    assert suite.executed() == ["test_sees_checkpoint"]


def test_a_failing_gate_gives_a_nonzero_exit_and_a_red_row(suite: ThrowawaySuite, infer_gates: Run) -> None:
    good = suite.marking_gate("test_a.py", "test_good")
    bad = suite.marking_gate("test_b.py", "test_bad", "assert 2 + 2 == 5")
    suite.write_manifest([gate_entry("demo.good", good), gate_entry("demo.bad", bad)])
    code, output = infer_gates("--manifest", str(suite.manifest))
    assert code == 1
    assert suite.executed() == ["test_good", "test_bad"]
    [bad_row] = [line for line in output.splitlines() if "demo.bad" in line and "│" in line]
    assert "failed" in bad_row and "assert (2 + 2) == 5" in bad_row

    # The same run in a terminal: the failed row is drawn red, the passed one green.
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "200", "TERM": "xterm"}
    env.pop("INFER_TEST_CHECKPOINT", None)
    env.pop("NO_COLOR", None)
    shown = subprocess.run(
        [sys.executable, "-m", "infer_cli.main", "gates", "--manifest", str(suite.manifest)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert shown.returncode == 1
    [red_row] = [line for line in shown.stdout.splitlines() if "demo.bad" in line and "│" in line]
    assert "\x1b[31m" in red_row
    [green_row] = [line for line in shown.stdout.splitlines() if "demo.good" in line and "│" in line]
    assert "\x1b[32m" in green_row and "\x1b[31m" not in green_row


def test_results_table_styles_failures_red() -> None:
    from throwaway_suite import gate_entry as entry

    from gates.runner.manifest import Gate

    def gate(name: str) -> Gate:
        raw = entry(f"demo.{name}", f"g/test.py::test_{name}")
        return Gate(raw["id"], raw["test"], raw["invariant"], (), 10, raw["why"])

    rows = (
        GateRow(gate("ok"), (), True, GateOutcome(gate("ok"), "passed", 0.1, "", "")),
        GateRow(gate("timeout"), (), True, GateOutcome(gate("timeout"), "timeout", 10.0, "ran past", "")),
        GateRow(gate("later"), ("gpu",), False, None),
    )
    report = RunReport("demo", Path("m.toml"), "run", "cpu", None, (), rows, now())
    table = results_table(report)
    assert [row.style for row in table.rows] == ["green", "red", "dim"]


def test_a_gate_that_skips_itself_counts_as_failed(suite: ThrowawaySuite, infer_gates: Run) -> None:
    skipper = suite.write_module(
        "test_a.py",
        """
        import pytest

        def test_skips():
            pytest.skip("checkpoint not around")

        def test_importorskip():
            pytest.importorskip("not_a_module_anywhere")

        @pytest.mark.xfail(reason="known bad")
        def test_expected_to_fail():
            assert False

        @pytest.fixture
        def unavailable():
            pytest.skip("fixture gave up")

        def test_skips_in_setup(unavailable):
            pass
        """,
    )
    names = ("test_skips", "test_importorskip", "test_expected_to_fail", "test_skips_in_setup")
    suite.write_manifest([gate_entry(f"demo.{name[5:]}", f"{skipper}::{name}") for name in names])
    code, _ = infer_gates("--manifest", str(suite.manifest), "--json", str(suite.root / "report.json"))
    assert code == 1
    results = {gate["id"]: gate for gate in json.loads((suite.root / "report.json").read_text())["gates"]}
    assert {gate_id: gate["result"] for gate_id, gate in results.items()} == {
        "demo.skips": "failed",
        "demo.importorskip": "failed",
        "demo.expected_to_fail": "failed",
        "demo.skips_in_setup": "failed",
    }
    assert "skipped itself (checkpoint not around)" in results["demo.skips"]["message"]
    assert "marked xfail (known bad)" in results["demo.expected_to_fail"]["message"]
    assert "fixture gave up" in results["demo.skips_in_setup"]["message"]


def test_a_gate_past_its_timeout_is_killed_and_failed(suite: ThrowawaySuite, infer_gates: Run) -> None:
    slow = suite.marking_gate("test_a.py", "test_slow", "import time; time.sleep(60)")
    after = suite.marking_gate("test_b.py", "test_after")
    suite.write_manifest([gate_entry("demo.slow", slow, timeout_s=3), gate_entry("demo.after", after)])
    code, output = infer_gates("--manifest", str(suite.manifest), "--json", str(suite.root / "report.json"))
    assert code == 1
    assert "ran past its timeout of 3s" in output
    results = {
        gate["id"]: gate["result"] for gate in json.loads((suite.root / "report.json").read_text())["gates"]
    }
    assert results == {"demo.slow": "timeout", "demo.after": "passed"}
    # The next gate still ran, in its own process.
    assert suite.executed()[-1] == "test_after"


def test_tier_cpu_leaves_gpu_gates_out_and_says_so(
    suite: ThrowawaySuite, infer_gates: Run, no_gpu: None
) -> None:
    suite.write_module(
        "conftest.py",
        """
        import pytest

        GATE_FIXTURE_NEEDS = {"device_pool": ("gpu",)}

        @pytest.fixture
        def device_pool():
            return None
        """,
    )
    cpu = suite.marking_gate("test_a.py", "test_cpu")
    gpu = suite.marking_gate("test_b.py", "test_gpu")
    pool = suite.marking_gate("test_c.py", "test_pool")
    suite.write_manifest(
        [
            gate_entry("demo.cpu", cpu),
            gate_entry("demo.gpu", gpu, needs=["gpu"]),
            gate_entry("demo.pool", pool, needs=["device_pool"]),
        ]
    )
    code, output = infer_gates("--manifest", str(suite.manifest), "--tier", "cpu")
    assert code == 0, output
    assert suite.executed() == ["test_cpu"]
    assert "not selected at tier cpu: demo.gpu (needs gpu)" in output
    assert "not selected at tier cpu: demo.pool (needs gpu)" in output


def test_a_tier_with_no_gate_says_so_and_passes(suite: ThrowawaySuite, infer_gates: Run) -> None:
    cpu = suite.marking_gate("test_a.py", "test_cpu")
    suite.write_manifest([gate_entry("demo.cpu", cpu)])
    code, output = infer_gates("--manifest", str(suite.manifest), "--tier", "gpu")
    assert code == 0
    assert "no gate of suite demo is selected at tier gpu" in output
    assert suite.executed() == []


def test_reports_record_a_run(suite: ThrowawaySuite, infer_gates: Run, no_gpu: None) -> None:
    good = suite.marking_gate("test_a.py", "test_good")
    bad = suite.marking_gate("test_b.py", "test_bad", "raise RuntimeError('boom')")
    gpu = suite.marking_gate("test_c.py", "test_gpu")
    suite.write_manifest(
        [
            gate_entry("demo.good", good),
            gate_entry("demo.bad", bad),
            gate_entry("demo.gpu", gpu, needs=["gpu"]),
        ]
    )
    json_path, junit_path = suite.root / "out" / "gates.json", suite.root / "out" / "gates.xml"
    code, _ = infer_gates(
        "--manifest",
        str(suite.manifest),
        "--tier",
        "cpu",
        "--json",
        str(json_path),
        "--junit",
        str(junit_path),
    )
    assert code == 1
    body = json.loads(json_path.read_text())
    assert (body["suite"], body["tier"], body["status"], body["ok"]) == ("demo", "cpu", "failed", False)
    results = {gate["id"]: gate for gate in body["gates"]}
    assert results["demo.good"]["result"] == "passed" and results["demo.good"]["seconds"] > 0
    assert results["demo.bad"]["result"] == "failed" and "boom" in results["demo.bad"]["message"]
    assert results["demo.gpu"]["result"] == "not-selected" and results["demo.gpu"]["base_needs"] == ["gpu"]

    suite_element = ET.parse(junit_path).getroot().find("testsuite")
    assert suite_element is not None
    assert (suite_element.get("tests"), suite_element.get("failures"), suite_element.get("skipped")) == (
        "3",
        "1",
        "1",
    )
    cases = {case.get("name"): case for case in suite_element.iter("testcase")}
    assert list(cases["demo.good"]) == []
    failure = cases["demo.bad"].find("failure")
    assert failure is not None and "boom" in (failure.get("message") or "")
    skipped = cases["demo.gpu"].find("skipped")
    assert skipped is not None and "needs gpu" in (skipped.get("message") or "")


def test_reports_record_why_nothing_ran(suite: ThrowawaySuite, infer_gates: Run) -> None:
    gate = suite.marking_gate("test_a.py", "test_parity")
    suite.write_manifest([gate_entry("demo.parity", gate, needs=["checkpoint"])], model_types=["qwen3"])
    json_path, junit_path = suite.root / "gates.json", suite.root / "gates.xml"
    code, _ = infer_gates(
        "--manifest", str(suite.manifest), "--json", str(json_path), "--junit", str(junit_path)
    )
    assert code == 2
    body = json.loads(json_path.read_text())
    assert body["status"] == "preflight-failed"
    assert body["problems"][0]["subject"] == "checkpoint"
    assert body["gates"][0]["result"] == "not-run"
    root = ET.parse(junit_path).getroot()
    failures = [case for case in root.iter("testcase") if case.find("failure") is not None]
    assert [case.get("name") for case in failures] == ["preflight: checkpoint"]


def test_every_gate_passing_exits_zero_through_the_alias(suite: ThrowawaySuite) -> None:
    first = suite.marking_gate("test_a.py", "test_first")
    params = suite.write_module(
        "test_b.py",
        """
        import pytest

        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_each(n):
            assert n > 0
        """,
    )
    suite.write_manifest([gate_entry("demo.first", first), gate_entry("demo.each", f"{params}::test_each")])
    env = {key: value for key, value in os.environ.items() if key != "INFER_TEST_CHECKPOINT"}
    done = subprocess.run(
        [sys.executable, "-m", "infer_cli.main", "run-gates", "--manifest", str(suite.manifest)],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "200"},
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert suite.executed() == ["test_first"]
    assert "demo.each" in done.stdout and "passed" in done.stdout


def test_a_stopped_run_kills_the_running_gate_and_says_why_a_gate_failed(suite: ThrowawaySuite) -> None:
    """SIGTERM to the runner (what `timeout` sends) must not leave the gate's pytest running: it has
    its own session, so nothing else would stop it. Failures are printed as they happen, so a run
    stopped later still shows them."""
    bad = suite.marking_gate("test_a.py", "test_bad", "assert 2 + 2 == 5")
    pid_file = suite.root / "gate.pid"
    slow = suite.marking_gate(
        "test_b.py",
        "test_slow",
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)",
    )
    suite.write_manifest([gate_entry("demo.bad", bad), gate_entry("demo.slow", slow)])
    json_path = suite.root / "gates.json"
    env = {key: value for key, value in os.environ.items() if key != "INFER_TEST_CHECKPOINT"}
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infer_cli.main",
            "gates",
            "--manifest",
            str(suite.manifest),
            "--json",
            str(json_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, "COLUMNS": "200"},
    )
    deadline = time.monotonic() + 90
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid_file.is_file(), "the slow gate never started"
    gate_pid = int(pid_file.read_text())
    runner.send_signal(signal.SIGTERM)
    output, _ = runner.communicate(timeout=60)
    assert runner.returncode != 0
    assert "assert (2 + 2) == 5" in output, output
    with pytest.raises(ProcessLookupError):
        os.kill(gate_pid, 0)
    # The JSON report was written when the first gate ended, and is what the stopped run leaves.
    body = json.loads(json_path.read_text())
    assert (body["status"], body["ok"]) == ("incomplete", False)
    results = {gate["id"]: gate["result"] for gate in body["gates"]}
    assert results == {"demo.bad": "failed", "demo.slow": "not-run"}


def test_gate_option_runs_the_named_gates_and_the_reports_say_so(
    suite: ThrowawaySuite, infer_gates: Run
) -> None:
    first = suite.marking_gate("test_a.py", "test_first")
    second = suite.marking_gate("test_b.py", "test_second")
    suite.write_manifest([gate_entry("demo.first", first), gate_entry("demo.second", second)])
    report = suite.root / "report.json"
    code, output = infer_gates(
        "--manifest", str(suite.manifest), "--gate", "demo.second", "--json", str(report)
    )
    assert code == 0, output
    assert suite.executed() == ["test_second"]
    assert "does not stand for the whole manifest" in output
    data = json.loads(report.read_text())
    assert data["only"] == ["demo.second"]
    assert {gate["id"]: gate["result"] for gate in data["gates"]} == {
        "demo.first": "not-selected",
        "demo.second": "passed",
    }


def test_gate_option_naming_no_gate_stops_before_anything_runs(
    suite: ThrowawaySuite, infer_gates: Run
) -> None:
    first = suite.marking_gate("test_a.py", "test_first")
    suite.write_manifest([gate_entry("demo.first", first)])
    code, output = infer_gates("--manifest", str(suite.manifest), "--gate", "demo.missing")
    assert code == 2
    assert "demo.missing" in output and "names no gate of suite demo" in output
    assert suite.executed() == []
