"""`infer gates --manifest NAME|PATH` (alias `run-gates`): run a suite's checked-in gate manifest.

Exit status: 0 when every selected gate passed (or `--check`/`--list` found nothing wrong, or the
tier selected no gate); 1 when a gate failed; 2 when the run stopped before executing anything
(manifest, membership or preflight problems, or a refused `--tensor-parallel-size`).
"""

from __future__ import annotations

import os
import signal
from enum import StrEnum
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from engine.contract import ContractError
from gates.runner import (
    Gate,
    GateOutcome,
    GateRunError,
    Manifest,
    Problem,
    RunOptions,
    RunReport,
    load_manifest,
    locate_manifest,
    run_manifest,
    write_json,
    write_junit,
)
from gates.runner.needs import DECODE_PATH_KNOBS
from gates.runner.preflight import checkpoint_argument
from gates.runner.reports import now
from infer_cli.engine_options import KNOBS, Knobs, knob_options

EXIT_GATE_FAILED = 1
EXIT_STOPPED = 2
_RESULT_STYLE = {
    "passed": "green",
    "failed": "red",
    "skipped": "red",
    "timeout": "red",
    "error": "red",
    "not-selected": "dim",
    "not-run": "yellow",
}


class TierOption(StrEnum):
    cpu = "cpu"
    gpu = "gpu"
    all = "all"


class _ConsoleObserver:
    """Draws a run: stage lines, a progress bar over the gates, one line per finished gate; with
    `--json`, also rewrites the report file after each gate (status `incomplete` until the end)."""

    def __init__(self, console: Console, json_path: Path | None) -> None:
        self._console = console
        self._json_path = json_path
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def stage(self, message: str) -> None:
        self._console.print(f"[dim]{message}…[/dim]")

    def run_started(self, gates: list[Gate]) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self._console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task("gates", total=len(gates))

    def gate_started(self, gate: Gate) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=gate.id)

    def gate_done(self, outcome: GateOutcome) -> None:
        style = _RESULT_STYLE[outcome.result]
        self._console.print(
            f"[{style}]{outcome.result:>7}[/{style}] {outcome.gate.id} ({outcome.seconds:.1f}s)"
        )
        if not outcome.passed and outcome.message:
            # Said now, not only in the final table: a run stopped part-way still tells why.
            self._console.print(f"        {outcome.message}", markup=False, highlight=False)
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task)

    def report_so_far(self, report: RunReport) -> None:
        if self._json_path is not None:
            write_json(report, self._json_path)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def manifest_table(manifest: Manifest) -> Table:
    suite = manifest.suite
    types = ", ".join(suite.model_types) or "none (no checkpoint)"
    table = Table(title=f"suite {suite.name} · {suite.gates_dir_shown} · model types: {types}")
    for column in ("gate", "invariant", "needs", "timeout", "test", "why"):
        table.add_column(column, overflow="fold")
    for gate in manifest.gates:
        table.add_row(
            gate.id, gate.invariant, ", ".join(gate.needs) or "-", f"{gate.timeout_s}s", gate.test, gate.why
        )
    return table


def problems_table(problems: tuple[Problem, ...] | list[Problem]) -> Table:
    table = Table(title=f"[red]{len(problems)} problem(s): nothing was run[/red]", title_justify="left")
    for column in ("stage", "subject", "problem"):
        table.add_column(column, overflow="fold")
    for problem in problems:
        table.add_row(problem.stage, problem.subject, problem.message, style="red")
    return table


def results_table(report: RunReport) -> Table:
    """One row per gate (gate, invariant, result, seconds); failures in red."""
    table = Table(title=f"suite {report.suite} · tier {report.tier}")
    for column in ("gate", "invariant", "result", "seconds", "detail"):
        table.add_column(column, overflow="fold")
    for row in report.rows:
        seconds = f"{row.outcome.seconds:.1f}" if row.outcome is not None else "-"
        if row.outcome is not None:
            detail = row.outcome.message.splitlines()[0] if row.outcome.message else ""
        elif not row.selected and report.only and row.gate.id not in report.only:
            detail = "not named by --gate"
        elif not row.selected:
            detail = f"needs {', '.join(row.base_needs)}"
        else:
            detail = ""
        table.add_row(
            row.gate.id, row.gate.invariant, row.result, seconds, detail, style=_RESULT_STYLE[row.result]
        )
    return table


def _write_reports(
    report: RunReport, json_path: Path | None, junit_path: Path | None, console: Console
) -> None:
    if json_path is not None:
        write_json(report, json_path)
        console.print(f"[dim]JSON report: {json_path}[/dim]")
    if junit_path is not None:
        write_junit(report, junit_path)
        console.print(f"[dim]JUnit report: {junit_path}[/dim]")


def _print_outcome(report: RunReport, console: Console) -> None:
    if report.problems:
        console.print(problems_table(report.problems))
        return
    if report.mode == "check":
        console.print(
            f"[green]check passed[/green]: {len(report.rows)} gate(s) listed, every one present, "
            f"no unlisted test, every gate module imports"
        )
        return
    unselected = [row for row in report.rows if not row.selected]
    if report.only:
        console.print(
            f"[yellow]--gate ran {len(report.rows) - len(unselected)} of {len(report.rows)} gate(s): "
            f"this run does not stand for the whole manifest[/yellow]"
        )
    for row in unselected:
        if report.only and row.gate.id not in report.only:
            continue
        console.print(
            f"[dim]not selected at tier {report.tier}: {row.gate.id} (needs {', '.join(row.base_needs)})[/dim]"
        )
    if not any(row.selected for row in report.rows):
        console.print(
            f"[yellow]no gate of suite {report.suite} is selected at tier {report.tier}: nothing to run[/yellow]"
        )
        return
    console.print(results_table(report))
    for outcome in report.ran:
        if not outcome.passed:
            console.rule(f"[red]{outcome.gate.id}: {outcome.result}")
            console.print(outcome.output_tail.strip()[-3000:], markup=False, highlight=False)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@knob_options("tensor_parallel_size", *DECODE_PATH_KNOBS, help_prefix="every gate's engines: ")
def gates_command(
    manifest: str = typer.Option(
        ..., "--manifest", help="Manifest NAME (manifests/NAME.toml) or PATH to a .toml."
    ),
    checkpoint: Path | None = typer.Option(
        None,
        "--checkpoint",
        help="Checkpoint folder, or a .gguf file (converted once into the cache), for gates that need "
        "one (default: $INFER_TEST_CHECKPOINT).",
    ),
    tier: TierOption = typer.Option(
        TierOption.all,
        "--tier",
        help="cpu: gates needing no GPU; gpu: the gates needing one; all: every gate.",
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="Validate, check membership and import every gate module; run nothing (no GPU, no checkpoint).",
    ),
    list_gates: bool = typer.Option(False, "--list", help="Print the manifest and exit."),
    junit: Path | None = typer.Option(None, "--junit", help="Write a JUnit XML report here."),
    json_out: Path | None = typer.Option(None, "--json", help="Write a JSON report here."),
    only: list[str] = typer.Option(
        [],
        "--gate",
        help="Run only this gate (repeatable; debugging: the reports record the subset, so the run "
        "does not stand for the whole manifest).",
    ),
    shared_process: bool = typer.Option(
        False,
        "--shared-process",
        help="Run the gates in one pytest process (the checkpoint is read once; gates marked isolated "
        "still get their own). A gate that fails or times out ends its process; the rest go on in a new one.",
    ),
    *,
    knobs: Knobs,
) -> None:
    console = Console()
    started = now()
    try:
        tensor_parallel_size = knobs.model_options().engine.tensor_parallel_size
    except ContractError as exc:
        raise typer.BadParameter(
            str(exc), param_hint=KNOBS[exc.field_name].flag if exc.field_name in KNOBS else None
        ) from None
    decode_path = {name: knobs[name] for name in DECODE_PATH_KNOBS if knobs[name] != KNOBS[name].default}
    try:
        loaded = load_manifest(locate_manifest(manifest))
    except GateRunError as exc:
        stopped = RunReport(
            suite=Path(manifest).stem,
            manifest=Path(manifest),
            mode="check" if check else "run",
            tier=tier.value,
            checkpoint=checkpoint,
            problems=tuple(exc.problems),
            rows=(),
            started=started,
            tensor_parallel_size=tensor_parallel_size,
        )
        console.print(problems_table(exc.problems))
        _write_reports(stopped, json_out, junit, console)
        raise typer.Exit(EXIT_STOPPED) from exc

    if list_gates:
        console.print(manifest_table(loaded))
        return

    given = None if check else checkpoint_argument(checkpoint, os.environ)
    if given is not None and given.suffix.lower() == ".gguf" and given.is_file():
        from infer_cli.progress import RichProgress
        from models.gguf import GGUFError, converted_checkpoint

        try:
            given = converted_checkpoint(given, RichProgress(console))
        except GGUFError as exc:
            console.print(f"infer gates: {exc}", style="red", markup=False, highlight=False)
            raise typer.Exit(EXIT_STOPPED) from exc
    options = RunOptions(
        mode="check" if check else "run",
        tier=tier.value,
        checkpoint=given,
        only=tuple(only),
        shared_process=shared_process,
        tensor_parallel_size=tensor_parallel_size,
        decode_path=decode_path,
    )
    console.print(
        f"[bold]infer gates[/bold] · suite {loaded.suite.name} · {len(loaded.gates)} gate(s) · {loaded.path}"
        + (f" · tensor-parallel size {tensor_parallel_size}" if tensor_parallel_size > 1 else "")
        + "".join(f" · {KNOBS[name].flag} {value}" for name, value in decode_path.items())
    )
    observer = _ConsoleObserver(console, json_out)
    # A stopped run (`timeout`, a job killed) unwinds through run_pytest, which kills the running
    # gate's process group: a gate runs in its own session and would otherwise keep the GPU.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        report = run_manifest(loaded, options, observer)
    finally:
        signal.signal(signal.SIGTERM, previous)
        observer.close()
    _print_outcome(report, console)
    _write_reports(report, json_out, junit, console)
    if report.problems:
        raise typer.Exit(EXIT_STOPPED)
    if not report.ok:
        raise typer.Exit(EXIT_GATE_FAILED)
