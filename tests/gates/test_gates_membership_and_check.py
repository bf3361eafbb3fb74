"""Membership and `--check`: the manifest and the gates folder must agree, every module must import."""

from __future__ import annotations

from collections.abc import Callable

from throwaway_suite import ThrowawaySuite, gate_entry

Run = Callable[..., tuple[int, str]]


def test_a_listed_gate_that_does_not_exist_fails_the_run_by_name(
    suite: ThrowawaySuite, infer_gates: Run
) -> None:
    present = suite.marking_gate("test_a.py", "test_present")
    suite.write_manifest(
        [gate_entry("demo.present", present), gate_entry("demo.gone", "suite_gates/test_a.py::test_gone")]
    )
    code, output = infer_gates("--manifest", str(suite.manifest))
    assert code == 2
    assert (
        "gate demo.gone" in output
        and "is listed but its test suite_gates/test_a.py::test_gone does not exist" in output
    )
    assert suite.executed() == []


def test_an_unlisted_gate_fails_the_run_by_name(suite: ThrowawaySuite, infer_gates: Run) -> None:
    listed = suite.marking_gate("test_a.py", "test_listed")
    suite.marking_gate("test_b.py", "test_forgotten")
    suite.write_manifest([gate_entry("demo.listed", listed)])
    code, output = infer_gates("--manifest", str(suite.manifest))
    assert code == 2
    assert "suite_gates/test_b.py::test_forgotten" in output
    assert "the manifest lists no gate for it" in output
    assert suite.executed() == []


def test_a_gate_module_that_does_not_import_is_named(suite: ThrowawaySuite, infer_gates: Run) -> None:
    good = suite.marking_gate("test_a.py", "test_good")
    suite.write_module("test_broken.py", "import not_a_module_anywhere\n\ndef test_broken():\n    pass\n")
    suite.write_manifest(
        [gate_entry("demo.good", good), gate_entry("demo.broken", "suite_gates/test_broken.py::test_broken")]
    )
    code, output = infer_gates("--manifest", str(suite.manifest), "--check")
    assert code == 2
    assert "suite_gates/test_broken.py" in output and "does not import or collect" in output
    assert "not_a_module_anywhere" in output


def test_a_gate_module_that_skips_itself_at_import_is_a_problem(
    suite: ThrowawaySuite, infer_gates: Run
) -> None:
    suite.write_module(
        "test_gpu_only.py",
        'import pytest\npytest.skip("no GPU here", allow_module_level=True)\n\ndef test_kernel():\n    pass\n',
    )
    suite.write_manifest(
        [gate_entry("demo.kernel", "suite_gates/test_gpu_only.py::test_kernel", needs=["gpu"])]
    )
    code, output = infer_gates("--manifest", str(suite.manifest), "--check")
    assert code == 2
    assert "skipped itself (no GPU here)" in output
    assert "gate demo.kernel" in output


def test_check_needs_no_checkpoint_and_no_gpu_and_runs_nothing(
    suite: ThrowawaySuite, infer_gates: Run, monkeypatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_gate = suite.marking_gate("test_a.py", "test_on_gpu")
    parity = suite.write_module(
        "test_b.py",
        """
        import pytest

        @pytest.mark.parametrize("length", [1, 17])
        def test_parity(length):
            raise AssertionError("must not run under --check")
        """,
    )
    suite.write_manifest(
        [
            gate_entry("demo.on_gpu", gpu_gate, needs=["gpu"]),
            gate_entry("demo.parity", f"{parity}::test_parity", needs=["checkpoint", "hf-reference"]),
        ],
        model_types=["qwen3"],
    )
    code, output = infer_gates("--manifest", str(suite.manifest), "--check")
    assert code == 0, output
    assert "check passed" in output and "2 gate(s) listed" in output
    assert suite.executed() == []


def test_manifest_problems_stop_before_collection(suite: ThrowawaySuite, infer_gates: Run) -> None:
    gate = suite.marking_gate("test_a.py", "test_a")
    suite.write_manifest([gate_entry("demo.a", gate, needs=["tpu"], colour="blue")])
    code, output = infer_gates("--manifest", str(suite.manifest), "--check")
    assert code == 2
    assert "unknown need 'tpu'" in output and "unknown key 'colour'" in output
    assert "collecting" not in output


def test_list_prints_the_manifest(suite: ThrowawaySuite, infer_gates: Run) -> None:
    gate = suite.marking_gate("test_a.py", "test_a")
    suite.write_manifest([gate_entry("demo.listed_gate", gate, needs=["gpu"], invariant="device")])
    code, output = infer_gates("--manifest", str(suite.manifest), "--list")
    assert code == 0
    assert "demo.listed_gate" in output and "device" in output and "gpu" in output
    assert suite.executed() == []


def test_a_manifest_name_resolves_under_manifests(
    suite: ThrowawaySuite, infer_gates: Run, monkeypatch
) -> None:
    gate = suite.marking_gate("test_a.py", "test_a")
    suite.write_manifest([gate_entry("demo.a", gate)])
    monkeypatch.chdir(suite.root)
    code, output = infer_gates("--manifest", "demo", "--check")
    assert code == 0, output
    code, output = infer_gates("--manifest", "no_such_suite", "--check")
    assert code == 2
    assert "no manifest named no_such_suite" in output and "demo" in output
