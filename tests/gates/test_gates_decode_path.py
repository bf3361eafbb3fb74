"""`infer gates --decode-fusion` and the other decode-path knobs (gates.runner.needs.DECODE_PATH_KNOBS)
on a throwaway suite: each reaches every engine a gate loads the gates' way unless the gate names
that knob itself, and the reports record what the run was given."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from throwaway_suite import ThrowawaySuite, gate_entry

Run = Callable[..., tuple[int, str]]
# The checkout under test: a throwaway suite's gates import its harness, not an installed copy's.
ROOT = Path(__file__).resolve().parents[2]


def test_the_decode_path_reaches_every_gate_engine_and_the_reports(
    suite: ThrowawaySuite, infer_gates: Run, tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    gate = suite.marking_gate(
        "test_a.py",
        "test_engine_draws_with_triton",
        """
                import os
                from pathlib import Path
                from gates.harness.serving import load_for_gate, paged_runner
                checkpoint = Path(os.environ["INFER_TEST_CHECKPOINT"])
                assert paged_runner(load_for_gate(checkpoint, num_kv_pages=16)).triton_draw
                named = load_for_gate(checkpoint, num_kv_pages=16, sampling_backend="torch")
                assert not paged_runner(named).triton_draw
        """,
    )
    suite.write_manifest([gate_entry("demo.path", gate, needs=["checkpoint"])], model_types=["qwen3"])
    report = suite.root / "r.json"
    args = ("--manifest", str(suite.manifest), "--checkpoint", str(tiny_qwen3), "--json", str(report))
    code, output = infer_gates(*args, "--sampling-backend", "triton")
    assert code == 0, output
    assert suite.executed() == ["test_engine_draws_with_triton"]
    assert json.loads(report.read_text())["decode_path"] == {"sampling_backend": "triton"}
    assert "--sampling-backend triton" in " ".join(output.split())

    # Without the option the engines draw with torch, and the gate above fails.
    code, output = infer_gates(*args)
    assert code == 1
    assert json.loads(report.read_text())["decode_path"] == {}


def test_a_bad_decode_path_value_is_refused_by_its_flag(
    suite: ThrowawaySuite, infer_gates: Run, tiny_qwen3: Path
) -> None:
    gate = suite.marking_gate("test_a.py", "test_parity")
    suite.write_manifest([gate_entry("demo.parity", gate, needs=["checkpoint"])], model_types=["qwen3"])
    code, output = infer_gates(
        "--manifest", str(suite.manifest), "--checkpoint", str(tiny_qwen3), "--sampling-backend", "cuda"
    )
    flat = " ".join(output.split())
    assert code == 2 and "--sampling-backend" in flat and "sampling_backend='cuda'" in flat, output
    assert suite.executed() == []
