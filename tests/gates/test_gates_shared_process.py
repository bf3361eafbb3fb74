"""`infer gates --shared-process`: many gates in one pytest process, each still judged on its own,
on throwaway suites. Gates write their process id, so a test can see which gates shared one."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from throwaway_suite import ThrowawaySuite, gate_entry

from gates.runner.manifest import load_manifest
from gates.runner.shared_process import shared_order

Run = Callable[..., tuple[int, str]]


def _pid_gate(suite: ThrowawaySuite, filename: str, name: str, body: str = "assert True") -> str:
    pids = suite.root / "pids"
    return (
        suite.write_module(
            filename,
            f"""
        import os

        def {name}():
            with open({str(pids)!r}, "a") as f:
                f.write("{name} " + str(os.getpid()) + "\\n")
            {body}
        """,
        )
        + f"::{name}"
    )


def _pids(suite: ThrowawaySuite) -> dict[str, int]:
    lines = (suite.root / "pids").read_text().split("\n")
    return {name: int(pid) for name, pid in (line.split() for line in lines if line)}


def _run(
    suite: ThrowawaySuite, infer_gates: Run, gates: list[dict[str, Any]]
) -> tuple[int, str, dict[str, Any]]:
    suite.write_manifest(gates)
    report = suite.root / "report.json"
    code, output = infer_gates("--manifest", str(suite.manifest), "--shared-process", "--json", str(report))
    return code, output, json.loads(report.read_text())


def _results(body: dict[str, Any]) -> dict[str, str]:
    return {gate["id"]: gate["result"] for gate in body["gates"]}


def test_passing_gates_share_one_process_and_an_isolated_one_gets_its_own(
    suite: ThrowawaySuite, infer_gates: Run
) -> None:
    a = _pid_gate(suite, "test_a.py", "test_a", "print('measured gap 0.0123')")
    b = _pid_gate(suite, "test_b.py", "test_b")
    alone = _pid_gate(suite, "test_c.py", "test_alone")
    code, output, body = _run(
        suite,
        infer_gates,
        [gate_entry("demo.a", a), gate_entry("demo.alone", alone, isolated=True), gate_entry("demo.b", b)],
    )
    assert code == 0, output
    assert body["shared_process"] is True
    assert _results(body) == {"demo.a": "passed", "demo.alone": "passed", "demo.b": "passed"}
    pids = _pids(suite)
    assert pids["test_a"] == pids["test_b"] != pids["test_alone"]
    # The isolated gate ran first, on a process no other gate had touched.
    assert list(pids) == ["test_alone", "test_a", "test_b"]
    # What a passing gate prints is kept in its own row, not its neighbour's.
    rows = {gate["id"]: gate for gate in body["gates"]}
    assert "measured gap 0.0123" in rows["demo.a"]["output_tail"]
    assert "measured gap" not in rows["demo.b"]["output_tail"]


def test_a_failing_gate_ends_its_process_and_the_rest_go_on_in_a_new_one(
    suite: ThrowawaySuite, infer_gates: Run
) -> None:
    first = _pid_gate(suite, "test_a.py", "test_first")
    bad = _pid_gate(suite, "test_b.py", "test_bad", "assert 2 + 2 == 5")
    after = _pid_gate(suite, "test_c.py", "test_after")
    code, _output, body = _run(
        suite,
        infer_gates,
        [gate_entry("demo.first", first), gate_entry("demo.bad", bad), gate_entry("demo.after", after)],
    )
    assert code == 1
    assert _results(body) == {"demo.first": "passed", "demo.bad": "failed", "demo.after": "passed"}
    rows = {gate["id"]: gate for gate in body["gates"]}
    assert "assert (2 + 2) == 5" in rows["demo.bad"]["message"]
    pids = _pids(suite)
    assert pids["test_first"] == pids["test_bad"] != pids["test_after"]


def test_a_gate_past_its_timeout_is_killed_alone(suite: ThrowawaySuite, infer_gates: Run) -> None:
    first = _pid_gate(suite, "test_a.py", "test_first")
    slow = _pid_gate(suite, "test_b.py", "test_slow", "import time; time.sleep(60)")
    after = _pid_gate(suite, "test_c.py", "test_after")
    code, output, body = _run(
        suite,
        infer_gates,
        [
            gate_entry("demo.first", first),
            gate_entry("demo.slow", slow, timeout_s=3),
            gate_entry("demo.after", after),
        ],
    )
    assert code == 1
    assert _results(body) == {"demo.first": "passed", "demo.slow": "timeout", "demo.after": "passed"}
    assert "ran past its timeout of 3s" in output
    pids = _pids(suite)
    assert pids["test_first"] == pids["test_slow"] != pids["test_after"]


def test_a_crash_fails_the_gate_that_was_running_only(suite: ThrowawaySuite, infer_gates: Run) -> None:
    crash = _pid_gate(suite, "test_a.py", "test_crash", "os._exit(3)")
    after = _pid_gate(suite, "test_b.py", "test_after")
    code, _output, body = _run(
        suite, infer_gates, [gate_entry("demo.crash", crash), gate_entry("demo.after", after)]
    )
    assert code == 1
    assert _results(body) == {"demo.crash": "error", "demo.after": "passed"}
    rows = {gate["id"]: gate for gate in body["gates"]}
    assert "exited 3 during this gate" in rows["demo.crash"]["message"]


def test_a_parametrized_gate_is_judged_on_all_its_tests(suite: ThrowawaySuite, infer_gates: Run) -> None:
    params = suite.write_module(
        "test_a.py",
        """
        import pytest

        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_each(n):
            assert n != 2
        """,
    )
    after = _pid_gate(suite, "test_b.py", "test_after")
    code, _output, body = _run(
        suite, infer_gates, [gate_entry("demo.each", f"{params}::test_each"), gate_entry("demo.after", after)]
    )
    assert code == 1
    assert _results(body) == {"demo.each": "failed", "demo.after": "passed"}
    rows = {gate["id"]: gate for gate in body["gates"]}
    # A failure stops the process (the third case never ran), and the message says so.
    assert rows["demo.each"]["message"].startswith("1 of 2 tests failed")
    assert "2 of its 3 tests ran" in rows["demo.each"]["message"]


def test_gates_needing_transformers_run_last_otherwise_in_manifest_order(suite: ThrowawaySuite) -> None:
    tests = [suite.marking_gate(f"test_{n}.py", f"test_{n}") for n in "abcd"]
    suite.write_manifest(
        [
            gate_entry("demo.a", tests[0], needs=["hf-reference"]),
            gate_entry("demo.b", tests[1]),
            gate_entry("demo.c", tests[2], isolated=True),
            gate_entry("demo.d", tests[3], needs=["gpu"]),
        ]
    )
    manifest = load_manifest(suite.manifest)
    assert [gate.id for gate in shared_order(manifest, manifest.gates)] == ["demo.b", "demo.d", "demo.a"]


def test_isolated_must_be_a_boolean(suite: ThrowawaySuite, infer_gates: Run) -> None:
    test = suite.marking_gate("test_a.py", "test_a")
    suite.write_manifest([gate_entry("demo.a", test, isolated="yes")])
    code, output = infer_gates("--manifest", str(suite.manifest), "--check")
    assert code == 2
    assert "isolated must be true or false" in output
