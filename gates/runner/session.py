"""The stages of `infer gates` after the manifest is loaded: membership, (check stops here), tier
and `--gate` selection, preflight, execution. Each stage that finds problems stops the run with all of them;
nothing executes after a problem. Output is left to an observer (the CLI draws it with rich).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gates.runner.execution import GateOutcome, gate_env, run_gates
from gates.runner.manifest import Gate, Manifest
from gates.runner.membership import collect, membership_problems
from gates.runner.needs import Tier, in_tier
from gates.runner.preflight import preflight
from gates.runner.problems import Problem
from gates.runner.reports import GateRow, Mode, RunReport, now
from gates.runner.shared_process import run_gates_shared


@dataclass(slots=True, frozen=True)
class RunOptions:
    mode: Mode
    tier: Tier
    checkpoint: Path | None
    # `--gate ID`: run only these gates of the tier (a debugging run; reports record the subset,
    # so it cannot pass for a run of the whole manifest).
    only: tuple[str, ...] = ()
    # `--shared-process`: the gates share one pytest process (shared_process.py says what holds).
    shared_process: bool = False
    # `--tensor-parallel-size`: every gate's engines run at it (preflight checks the split).
    tensor_parallel_size: int = 1
    # `--decode-fusion` and the other DECODE_PATH_KNOBS the run was given, by knob name: every
    # gate's engines run with them (empty: the defaults).
    decode_path: Mapping[str, object] = field(default_factory=dict)


class Observer(Protocol):
    def stage(self, message: str) -> None: ...

    def run_started(self, gates: list[Gate]) -> None: ...

    def gate_started(self, gate: Gate) -> None: ...

    def gate_done(self, outcome: GateOutcome) -> None: ...

    def report_so_far(self, report: RunReport) -> None:
        """After each gate: the run's report with the gates finished so far (`finished` False)."""
        ...


def run_manifest(manifest: Manifest, options: RunOptions, observer: Observer) -> RunReport:
    started = now()
    needs = {gate.id: tuple(sorted(manifest.base_needs(gate))) for gate in manifest.gates}
    check = options.mode == "check"
    wanted = set(options.only)
    selected = {
        gate.id: check or (in_tier(needs[gate.id], options.tier) and (not wanted or gate.id in wanted))
        for gate in manifest.gates
    }

    def report(
        problems: list[Problem], outcomes: list[GateOutcome] | None = None, finished: bool = True
    ) -> RunReport:
        by_id = {outcome.gate.id: outcome for outcome in outcomes or []}
        rows = tuple(
            GateRow(gate, needs[gate.id], selected[gate.id], by_id.get(gate.id)) for gate in manifest.gates
        )
        return RunReport(
            suite=manifest.suite.name,
            manifest=manifest.path,
            mode=options.mode,
            tier=options.tier,
            checkpoint=options.checkpoint,
            problems=tuple(problems),
            rows=rows,
            started=started,
            only=options.only,
            shared_process=options.shared_process,
            tensor_parallel_size=options.tensor_parallel_size,
            decode_path=dict(options.decode_path),
            finished=finished,
        )

    observer.stage(f"collecting {manifest.suite.gates_dir_shown} (imports every gate module)")
    problems = membership_problems(manifest, collect(manifest))
    if problems or check:
        return report(problems)
    listed = {gate.id for gate in manifest.gates}
    unknown = [gate_id for gate_id in options.only if gate_id not in listed]
    if unknown:
        return report(
            [
                Problem("selection", gate_id, f"--gate names no gate of suite {manifest.suite.name}")
                for gate_id in unknown
            ]
        )

    chosen = [gate for gate in manifest.gates if selected[gate.id]]
    if not chosen:
        return report([])
    observer.stage(f"preflight of {len(chosen)} gate(s)")
    checked = preflight(manifest, chosen, options.checkpoint, options.tensor_parallel_size)
    if checked.problems:
        return report(list(checked.problems))

    observer.run_started(chosen)
    checkpoint = checked.checkpoint.path if checked.checkpoint is not None else options.checkpoint
    execute = run_gates_shared if options.shared_process else run_gates
    done: list[GateOutcome] = []

    def gate_done(outcome: GateOutcome) -> None:
        done.append(outcome)
        observer.gate_done(outcome)
        observer.report_so_far(report([], done, finished=False))

    env = gate_env(checkpoint, options.tensor_parallel_size, options.decode_path)
    outcomes = execute(manifest, chosen, env, observer.gate_started, gate_done)
    return report([], outcomes)
