"""`python -m gates.runner.ci`: every manifest checked, cpu tiers run on tiny synthetic checkpoints
(Gemma 3 on its real weights)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from throwaway_suite import ThrowawaySuite, gate_entry

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_ci(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gates.runner.ci", "--root", str(root)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1", **env},
        timeout=300,
    )


def test_ci_checks_every_manifest_and_runs_cpu_tiers_on_synthetic_checkpoints(suite: ThrowawaySuite) -> None:
    suite.name, suite.gates_dir = "qwen3", "gates/qwen3"
    scheduling = suite.root / "scheduling"
    gate = suite.marking_gate(
        "test_config.py",
        "test_reads_the_synthetic_checkpoint",
        "import json, os; "
        "assert json.load(open(os.path.join(os.environ['INFER_TEST_CHECKPOINT'], 'config.json')))['model_type'] == 'qwen3'; "
        f"open({str(scheduling)!r}, 'a').write(os.environ.get('INFER_GATE_DECODE_PATH', '') + '|')",
    )
    suite.write_manifest(
        [gate_entry("qwen3.reads_config", gate, needs=["checkpoint"])], model_types=["qwen3"]
    )

    gpu_only = ThrowawaySuite(root=suite.root, name="kernels", gates_dir="gates/kernels")
    kernel = gpu_only.write_module(
        "test_kernel.py", "def test_kernel():\n    raise AssertionError('needs a GPU')\n"
    )
    gpu_only.write_manifest([gate_entry("kernels.kernel", f"{kernel}::test_kernel", needs=["gpu"])])

    done = run_ci(suite.root)
    assert done.returncode == 0, done.stdout + done.stderr
    # Twice: as served by default (async scheduling), then synchronous on the gate's engines.
    assert suite.executed() == ["test_reads_the_synthetic_checkpoint"] * 2
    assert scheduling.read_text() == '|{"async_scheduling": false}|'
    assert "tier cpu --no-async-scheduling" in done.stdout
    assert "no cpu-tier gate in this suite" in done.stdout
    assert "on a tiny synthetic qwen3 checkpoint" in done.stdout


def test_ci_fails_when_a_manifest_does_not_check(suite: ThrowawaySuite) -> None:
    suite.marking_gate("test_a.py", "test_unlisted")
    suite.write_manifest([])
    done = run_ci(suite.root)
    assert done.returncode == 1
    assert "the manifest lists no gate for it" in done.stdout


def test_ci_runs_a_cpu_tier_on_real_weights_when_their_variable_names_them(
    suite: ThrowawaySuite, tmp_path: Path
) -> None:
    real = tmp_path / "gemma-3-270m"
    real.mkdir()
    (real / "config.json").write_text('{"model_type": "gemma3_text", "marker": "real"}')
    suite.name, suite.gates_dir = "gemma3", "gates/gemma3"
    gate = suite.marking_gate(
        "test_config.py",
        "test_reads_the_real_checkpoint",
        "import json, os; "
        "assert json.load(open(os.path.join(os.environ['INFER_TEST_CHECKPOINT'], 'config.json')))['marker'] == 'real'",
    )
    suite.write_manifest(
        [gate_entry("gemma3.reads_config", gate, needs=["checkpoint"])], model_types=["gemma3"]
    )
    done = run_ci(suite.root, INFER_GEMMA3_CHECKPOINT=str(real))
    assert done.returncode == 0, done.stdout + done.stderr
    assert suite.executed() == ["test_reads_the_real_checkpoint"] * 2
    assert "on the real gemma3 weights" in done.stdout


def test_ci_runs_the_gemma3_cpu_tier_on_the_embedded_weights_by_default(suite: ThrowawaySuite) -> None:
    """No INFER_GEMMA3_CHECKPOINT: the packaged Gemma 3 270M, converted once into the cache."""
    suite.name, suite.gates_dir = "gemma3", "gates/gemma3"
    gate = suite.marking_gate(
        "test_config.py",
        "test_reads_the_embedded_checkpoint",
        "import json, os; "
        "c = json.load(open(os.path.join(os.environ['INFER_TEST_CHECKPOINT'], 'config.json'))); "
        "assert (c['model_type'], c['hidden_size'], c['num_hidden_layers']) == ('gemma3_text', 640, 18)",
    )
    suite.write_manifest(
        [gate_entry("gemma3.reads_config", gate, needs=["checkpoint"])], model_types=["gemma3"]
    )
    done = run_ci(suite.root, INFER_GEMMA3_CHECKPOINT="")
    assert done.returncode == 0, done.stdout + done.stderr
    assert suite.executed() == ["test_reads_the_embedded_checkpoint"] * 2
    assert "on the real gemma3 weights" in done.stdout


def test_ci_runs_the_gemma3_cpu_tier_on_the_tiny_checkpoint_when_asked(suite: ThrowawaySuite) -> None:
    suite.name, suite.gates_dir = "gemma3", "gates/gemma3"
    gate = suite.marking_gate(
        "test_config.py",
        "test_reads_the_tiny_checkpoint",
        "import json, os; "
        "c = json.load(open(os.path.join(os.environ['INFER_TEST_CHECKPOINT'], 'config.json'))); "
        "assert c['model_type'] == 'gemma3_text' and c['hidden_size'] < 640",
    )
    suite.write_manifest(
        [gate_entry("gemma3.reads_config", gate, needs=["checkpoint"])], model_types=["gemma3"]
    )
    done = run_ci(suite.root, INFER_GEMMA3_CHECKPOINT="tiny")
    assert done.returncode == 0, done.stdout + done.stderr
    assert suite.executed() == ["test_reads_the_tiny_checkpoint"] * 2
    assert "on a tiny synthetic gemma3 checkpoint" in done.stdout


def test_ci_names_a_failed_gate_and_prints_its_output_after_the_table(suite: ThrowawaySuite) -> None:
    """CI keeps only the end of the log: the failed gate, its message and its output come last."""
    suite.name, suite.gates_dir = "qwen3", "gates/qwen3"
    gate = suite.marking_gate(
        "test_config.py",
        "test_fails_loudly",
        "print('the output line that says why'); raise AssertionError('bound 1e-3 crossed by 5e-3')",
    )
    suite.write_manifest(
        [gate_entry("qwen3.fails_loudly", gate, needs=["checkpoint"])], model_types=["qwen3"]
    )
    done = run_ci(suite.root)
    assert done.returncode == 1
    after = done.stdout.partition("gate suites")[2]
    assert "failed: qwen3.fails_loudly" in after
    after_table = after.rsplit("└", 1)[1]
    # Both scheduling modes failed: each is printed, with the message and the gate's own output.
    assert after_table.count("qwen3.fails_loudly") == 2
    assert after_table.count("bound 1e-3 crossed by 5e-3") >= 2
    assert "the output line that says why" in after_table


def test_ci_failures_read_from_a_report_name_problems_and_failed_gates(tmp_path: Path) -> None:
    from gates.runner.ci import failures_in

    report = tmp_path / "report.json"
    report.write_text(
        '{"problems": [{"stage": "preflight", "subject": "checkpoint", "message": "no config.json"}],'
        ' "gates": [{"id": "a.passes", "selected": true, "result": "passed"},'
        ' {"id": "a.skipped", "selected": false, "result": "not-selected"},'
        ' {"id": "a.times_out", "selected": true, "result": "timeout", "message": "ran past 900s",'
        ' "output_tail": "last line"}]}'
    )
    found = failures_in(report)
    assert [f.subject for f in found] == ["preflight: checkpoint", "a.times_out"]
    assert found[1].message == "timeout: ran past 900s" and found[1].output_tail == "last line"
    missing = failures_in(tmp_path / "absent.json")
    assert len(missing) == 1 and "no readable report" in missing[0].message
