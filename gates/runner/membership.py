"""Membership: the manifest and the suite's folder must list the same gates.

pytest collects the gates folder in a child process (importing every gate module, which is also
`--check`'s compile contract). Then every listed gate must match a collected test, and every
collected test must belong to a listed gate; each miss is named. A gate's `test` matches the
collected node ids equal to it or below it (its parametrizations, or a class's methods).
"""

from __future__ import annotations

from dataclasses import dataclass

from gates.runner.manifest import Manifest
from gates.runner.problems import Problem
from gates.runner.pytest_process import run_pytest

COLLECT_TIMEOUT_S = 300


@dataclass(slots=True, frozen=True)
class Collection:
    items: tuple[str, ...]
    problems: tuple[Problem, ...]


def _covers(test: str, item: str) -> bool:
    return item == test or item.startswith((f"{test}[", f"{test}::"))


def collect(manifest: Manifest) -> Collection:
    suite = manifest.suite
    run = run_pytest(suite.root, ["--collect-only", "-q", suite.gates_dir_shown], COLLECT_TIMEOUT_S)
    if run.timed_out:
        return Collection(
            (), (Problem("membership", suite.gates_dir_shown, f"collection ran past {COLLECT_TIMEOUT_S}s"),)
        )
    if run.report is None:
        return Collection(
            (),
            (
                Problem(
                    "membership",
                    suite.gates_dir_shown,
                    f"pytest failed before collecting:\n{run.output_tail}",
                ),
            ),
        )
    problems = [
        Problem(
            "membership",
            error["nodeid"] or suite.gates_dir_shown,
            f"does not import or collect:\n{error['message']}",
        )
        for error in run.report.get("collect_errors", [])
    ]
    return Collection(tuple(run.report.get("items", [])), tuple(problems))


def membership_problems(manifest: Manifest, collection: Collection) -> list[Problem]:
    problems = list(collection.problems)
    for gate in manifest.gates:
        if not any(_covers(gate.test, item) for item in collection.items):
            problems.append(
                Problem("membership", f"gate {gate.id}", f"is listed but its test {gate.test} does not exist")
            )
    for item in collection.items:
        if not any(_covers(gate.test, item) for gate in manifest.gates):
            problems.append(
                Problem(
                    "membership",
                    item,
                    f"is in {manifest.suite.gates_dir_shown} but the manifest lists no gate for it",
                )
            )
    return problems
