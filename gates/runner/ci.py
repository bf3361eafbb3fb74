"""What `make test` runs for the gate suites: `python -m gates.runner.ci [--root DIR]`.

For every manifests/*.toml:
1. `infer gates --manifest M --check` (validation, membership, every gate module imports);
2. if the suite has cpu-tier gates, `infer gates --manifest M --tier cpu --shared-process`, against a tiny
   synthetic checkpoint of the suite's model line (`infer synth FAMILY --preset tiny`, made once
   per family in a temporary folder) when those gates need a checkpoint. A line with real weights
   runs on them instead: Gemma 3 on the packaged 270M by default (`embedded`, converted once into
   the cache by models.gguf.embedded_gemma3_dir), or on the Hugging Face directory its variable in
   REAL_CHECKPOINT_ENV names; `tiny` there asks for the synthetic checkpoint;
3. for a suite whose cpu-tier gates serve a checkpoint, the same run again with
   `--no-async-scheduling` on every gate's engine (async scheduling is the default): both scheduling
   modes are gated on every run.
A suite with no cpu-tier gate is reported as such and does not fail the run. Exit 1 if any step
failed. Each cpu run writes its JSON report; a failed run's gates are named in the table, and after
the table each one's message and the end of its output are printed: CI keeps only the end of the log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gates.runner.manifest import Manifest, load_manifest
from gates.runner.model_types import line_of
from gates.runner.needs import CHECKPOINT, HF_REFERENCE, in_tier
from gates.runner.problems import GateRunError
from models.registry import ModelLoadError

# Synthetic family per model line (models/synth's families and their model types).
_FAMILY_OF_LINE = {"qwen3": "qwen3", "gemma3": "gemma3", "gemma4": "gemma4", "qwen3_5": "qwen35"}
# Per family: the variable naming a Hugging Face directory of its real weights, used in place of
# the tiny synthetic checkpoint when set.
REAL_CHECKPOINT_ENV = {"gemma3": "INFER_GEMMA3_CHECKPOINT"}
# The value that asks for the weights infer ships instead of a directory, and the one that asks for
# the tiny synthetic checkpoint.
EMBEDDED = "embedded"
SYNTHETIC = "tiny"
# What a family's cpu tier runs on when its variable is unset: `make test` gates Gemma 3 on the
# real weights infer ships.
REAL_CHECKPOINT_DEFAULT = {"gemma3": EMBEDDED}
# The engine flags of the second cpu-tier run of every suite that serves a checkpoint.
SYNCHRONOUS = ("--no-async-scheduling",)
# Lines of a failed gate's output printed after the table.
FAILURE_TAIL_LINES = 30


def _real_checkpoint(family: str) -> str | None:
    value = os.environ.get(REAL_CHECKPOINT_ENV.get(family, ""), "").strip()
    value = value or REAL_CHECKPOINT_DEFAULT.get(family, SYNTHETIC)
    if value == SYNTHETIC:
        return None
    if value != EMBEDDED or family != "gemma3":
        return value
    from models.gguf import embedded_gemma3_dir

    return str(embedded_gemma3_dir())


@dataclass(slots=True, frozen=True)
class Failure:
    """A gate (or a problem that stopped the run) of a failed step, from the run's JSON report."""

    subject: str
    message: str
    output_tail: str = ""


@dataclass(slots=True, frozen=True)
class Step:
    manifest: str
    step: str
    ok: bool
    note: str
    failures: tuple[Failure, ...] = ()


def failures_in(report_path: Path) -> tuple[Failure, ...]:
    """The problems and the selected gates that did not pass, as the report at `report_path` has
    them; one stand-in failure when the report is missing or unreadable."""
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError) as exc:
        return (Failure(str(report_path), f"no readable report: {exc}"),)
    found = [Failure(f"{p['stage']}: {p['subject']}", p["message"]) for p in report.get("problems", [])]
    for gate in report.get("gates", []):
        if gate.get("selected") and gate.get("result") != "passed":
            message = f"{gate['result']}: {gate.get('message', '')}".strip()
            found.append(Failure(gate["id"], message, gate.get("output_tail", "")))
    return tuple(found)


def _infer(*args: str, cwd: Path) -> int:
    command = [sys.executable, "-m", "infer_cli.main", *args]
    return subprocess.run(command, cwd=cwd, check=False).returncode


def _family_for(manifest: Manifest) -> str | None:
    for model_type in manifest.suite.model_types:
        family = _FAMILY_OF_LINE.get(line_of(model_type))
        if family is not None:
            return family
    return None


def _cpu_run(
    manifest_path: Path, root: Path, scratch: Path, made: dict[str, Path], scheduling: tuple[str, ...] = ()
) -> Step:
    """The suite's cpu tier; `scheduling`: engine flags every gate's engine takes (the step is named
    after them), for a suite whose gates serve a checkpoint. Without one there is nothing to run."""
    name = manifest_path.stem
    label = " ".join(("tier cpu", *scheduling))
    try:
        manifest = load_manifest(manifest_path)
    except GateRunError as exc:
        return Step(name, label, False, f"manifest does not load: {exc}")
    cpu_gates = [gate for gate in manifest.gates if in_tier(manifest.base_needs(gate), "cpu")]
    if not cpu_gates:
        return Step(name, label, True, "no cpu-tier gate in this suite: nothing to run at tier cpu")
    # One shared process per suite, as the GPU sessions run it (per-gate processes have their own tests).
    args = ["gates", "--manifest", str(manifest_path), "--tier", "cpu", "--shared-process", *scheduling]
    needs_checkpoint = any(manifest.base_needs(g) & {CHECKPOINT, HF_REFERENCE} for g in cpu_gates)
    if scheduling and not needs_checkpoint:
        return Step(name, label, True, "no cpu-tier gate serves a checkpoint: nothing scheduled to gate")
    note = f"{len(cpu_gates)} gate(s)"
    if needs_checkpoint:
        family = _family_for(manifest)
        if family is None:
            types = ", ".join(manifest.suite.model_types)
            return Step(name, label, False, f"no synthetic family for model types {types}")
        try:
            real = _real_checkpoint(family)
        except ModelLoadError as exc:  # the embedded model's package or conversion
            return Step(name, label, False, f"{REAL_CHECKPOINT_ENV[family]}={EMBEDDED}: {exc}")
        if real:
            args += ["--checkpoint", real]
            note += f" on the real {family} weights at {real}"
        else:
            if family not in made:
                out = scratch / f"{family}-tiny"
                if _infer("synth", family, "--preset", "tiny", "--out", str(out), cwd=root) != 0:
                    return Step(name, label, False, f"infer synth {family} --preset tiny failed")
                made[family] = out
            args += ["--checkpoint", str(made[family])]
            note += f" on a tiny synthetic {family} checkpoint"
    report = scratch / "reports" / f"{name}_{label.replace(' ', '_')}.json"
    code = _infer(*args, "--json", str(report), cwd=root)
    if code == 0:
        return Step(name, label, True, note)
    failures = failures_in(report)
    failed = ", ".join(failure.subject for failure in failures)
    return Step(name, label, False, f"{note}: exit {code}; failed: {failed}", failures)


def print_failures(steps: list[Step], console: Console) -> None:
    """After the table: each failed gate's message and the end of its output."""
    for step in steps:
        for failure in step.failures:
            console.rule(f"[red]{step.manifest} · {step.step} · {failure.subject}")
            console.print(failure.message, markup=False, highlight=False)
            tail = failure.output_tail.rstrip().splitlines()[-FAILURE_TAIL_LINES:]
            if tail:
                console.print("\n".join(tail), markup=False, highlight=False)


def run(root: Path, console: Console) -> int:
    manifests = sorted((root / "manifests").glob("*.toml"))
    if not manifests:
        console.print(f"[yellow]no manifests in {root / 'manifests'}: no gate suite to check[/yellow]")
        return 0
    steps: list[Step] = []
    with tempfile.TemporaryDirectory(prefix="infer-gates-ci-") as scratch:
        made: dict[str, Path] = {}
        for manifest_path in manifests:
            console.rule(f"[bold]{manifest_path.stem}")
            code = _infer("gates", "--manifest", str(manifest_path), "--check", cwd=root)
            steps.append(Step(manifest_path.stem, "--check", code == 0, "" if code == 0 else f"exit {code}"))
            if code == 0:
                steps.append(_cpu_run(manifest_path, root, Path(scratch), made))
                steps.append(_cpu_run(manifest_path, root, Path(scratch), made, SYNCHRONOUS))
    table = Table(title="gate suites")
    for column in ("manifest", "step", "result", "note"):
        table.add_column(column)
    for step in steps:
        style = "green" if step.ok else "red"
        table.add_row(step.manifest, step.step, "ok" if step.ok else "failed", step.note, style=style)
    console.print(table)
    print_failures(steps, console)
    return 0 if all(step.ok for step in steps) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root holding manifests/")
    args = parser.parse_args(argv)
    return run(args.root.resolve(), Console())


if __name__ == "__main__":
    sys.exit(main())
