"""`infer gates --tensor-parallel-size N` and the `gpus:N` need, on throwaway suites: the need is
met by gloo processes without CUDA and by N visible GPUs with it (the count faked here), the size
reaches every gate's engines, and a size the checkpoint or the machine cannot take is refused by
name before any gate runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from throwaway_suite import ThrowawaySuite, gate_entry

from gates.runner.manifest import load_manifest
from gates.runner.needs import gpus_of, in_tier
from gates.runner.problems import GateRunError

Run = Callable[..., tuple[int, str]]
# The checkout under test: a throwaway suite's gates import its harness, not an installed copy's.
ROOT = Path(__file__).resolve().parents[2]


def fake_cuda(monkeypatch: pytest.MonkeyPatch, visible: int) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)


def test_gpus_needs_parse_and_stay_out_of_the_gpu_tier(suite: ThrowawaySuite) -> None:
    assert [gpus_of(n) for n in ("gpus:2", "gpus:16", "gpus:0", "gpus:", "gpus:x", "gpus:02", "gpu")] == [
        2,
        16,
        None,
        None,
        None,
        None,
        None,
    ]
    gate = suite.marking_gate("test_a.py", "test_tp")
    suite.write_manifest([gate_entry("demo.tp", gate, needs=["gpus:2"])])
    manifest = load_manifest(suite.manifest)
    needs = manifest.base_needs(manifest.gates[0])
    assert needs == {"gpus:2"}
    assert in_tier(needs, "cpu") and not in_tier(needs, "gpu")

    suite.write_manifest([gate_entry("demo.tp", gate, needs=["gpus:0", "gpus:two"])])
    with pytest.raises(GateRunError) as caught:
        load_manifest(suite.manifest)
    messages = [str(p) for p in caught.value.problems]
    assert any("unknown need 'gpus:0'" in m and "gpus:N with N ≥ 1" in m for m in messages), messages
    assert any("unknown need 'gpus:two'" in m for m in messages), messages


def test_a_gpus_need_is_met_by_gloo_processes_without_cuda(
    suite: ThrowawaySuite, infer_gates: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda(monkeypatch, visible=0)
    gate = suite.marking_gate("test_a.py", "test_tp")
    suite.write_manifest([gate_entry("demo.tp", gate, needs=["gpus:2"])])
    code, output = infer_gates("--manifest", str(suite.manifest), "--tier", "cpu")
    assert code == 0, output
    assert suite.executed() == ["test_tp"]


def test_too_few_visible_gpus_fail_closed_naming_both_counts(
    suite: ThrowawaySuite, infer_gates: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda(monkeypatch, visible=1)
    free = suite.marking_gate("test_a.py", "test_free")
    tp = suite.marking_gate("test_b.py", "test_tp")
    suite.write_manifest([gate_entry("demo.free", free), gate_entry("demo.tp", tp, needs=["gpus:2"])])
    code, output = infer_gates("--manifest", str(suite.manifest), "--json", str(suite.root / "r.json"))
    assert code == 2
    flat = " ".join(output.split())
    assert "2 ranks need a GPU each and 1 is visible" in flat and "needed by demo.tp" in flat, output
    assert suite.executed() == []
    [problem] = json.loads((suite.root / "r.json").read_text())["problems"]
    assert (problem["stage"], problem["subject"]) == ("preflight", "gpus:2")

    fake_cuda(monkeypatch, visible=2)
    code, output = infer_gates("--manifest", str(suite.manifest))
    assert code == 0, output
    assert suite.executed() == ["test_free", "test_tp"]


def test_the_size_reaches_every_gate_engine_and_the_reports(
    suite: ThrowawaySuite, infer_gates: Run, tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gate that loads the checkpoint the gates' way gets a sharded engine at the run's size
    (a worker process per rank past rank 0), unless it names a size itself."""
    fake_cuda(monkeypatch, visible=0)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    gate = suite.marking_gate(
        "test_a.py",
        "test_engine_is_sharded",
        """
                import os
                from pathlib import Path
                from engine.parallel.runner import TensorParallelRunner
                from gates.harness.serving import batch_scheduler, close_engine, load_for_gate
                assert os.environ["INFER_GATE_TENSOR_PARALLEL_SIZE"] == "2"
                checkpoint = Path(os.environ["INFER_TEST_CHECKPOINT"])
                model = load_for_gate(checkpoint, num_kv_pages=16)
                runner = batch_scheduler(model).runner
                assert isinstance(runner, TensorParallelRunner), type(runner)
                assert len(runner.worker_pids()) == 1
                close_engine(model)
                single = load_for_gate(checkpoint, num_kv_pages=16, tensor_parallel_size=1)
                assert not isinstance(batch_scheduler(single).runner, TensorParallelRunner)
        """,
    )
    suite.write_manifest([gate_entry("demo.sharded", gate, needs=["checkpoint"])], model_types=["qwen3"])
    report = suite.root / "r.json"
    args = ("--manifest", str(suite.manifest), "--checkpoint", str(tiny_qwen3), "--json", str(report))
    code, output = infer_gates(*args, "--tensor-parallel-size", "2")
    assert code == 0, output
    assert suite.executed() == ["test_engine_is_sharded"]
    assert json.loads(report.read_text())["tensor_parallel_size"] == 2

    # Without the option the gates' engines run on one rank, and the gate above fails.
    code, output = infer_gates(*args)
    assert code == 1
    assert json.loads(report.read_text())["tensor_parallel_size"] == 1


def test_a_size_the_checkpoint_or_machine_cannot_take_is_refused_before_any_gate(
    suite: ThrowawaySuite, infer_gates: Run, tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = suite.marking_gate("test_a.py", "test_parity")
    suite.write_manifest([gate_entry("demo.parity", gate, needs=["checkpoint"])], model_types=["qwen3"])
    args = ("--manifest", str(suite.manifest), "--checkpoint", str(tiny_qwen3))

    fake_cuda(monkeypatch, visible=0)
    code, output = infer_gates(*args, "--tensor-parallel-size", "3")
    flat = " ".join(output.split())
    assert code == 2
    assert "--tensor-parallel-size 3: field 'num_attention_heads' = 4" in flat, output
    assert suite.executed() == []

    code, output = infer_gates(*args, "--tensor-parallel-size", "0")
    assert code == 2 and "tensor_parallel_size=0" in " ".join(output.split())

    fake_cuda(monkeypatch, visible=1)
    code, output = infer_gates(*args, "--tensor-parallel-size", "2")
    flat = " ".join(output.split())
    assert code == 2
    assert "--tensor-parallel-size 2: each rank needs a GPU of its own and 1 is visible" in flat, output
    assert suite.executed() == []
