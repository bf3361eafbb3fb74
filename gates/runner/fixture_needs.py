"""Named fixture needs: fixtures a conftest declares usable in a manifest's `needs`.

A conftest on the suite's path (the suite root's, each folder's down to the gates folder, and
any inside it) declares, at module level, a literal

    GATE_FIXTURE_NEEDS = {"checkpoint_path": ("checkpoint",), "cuda_device": ("gpu",)}

mapping each fixture it defines to the base needs that fixture implies. A manifest may then name
the fixture in `needs`; the runner preflights and tiers the gate on the implied base needs. The
conftest is read as source (ast), never imported, so a manifest validates on any machine.
A declaration whose fixture the same conftest does not define is an error, and so is a fixture
implying something other than a base need.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gates.runner.needs import BASE_NEEDS
from gates.runner.problems import Problem

DECLARATION = "GATE_FIXTURE_NEEDS"


@dataclass(slots=True, frozen=True)
class FixtureNeed:
    name: str
    implies: tuple[str, ...]
    declared_in: Path


def conftests_for(root: Path, gates_dir: Path) -> list[Path]:
    """The conftest.py files pytest would load for tests in `gates_dir`, outermost first."""
    found: list[Path] = []
    folder = root
    candidates = [root]
    for part in gates_dir.relative_to(root).parts:
        folder = folder / part
        candidates.append(folder)
    for candidate in candidates:
        conftest = candidate / "conftest.py"
        if conftest.is_file():
            found.append(conftest)
    if gates_dir.is_dir():
        found.extend(path for path in sorted(gates_dir.rglob("conftest.py")) if path.parent != gates_dir)
    return found


def _fixture_name(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The fixture's name if `node` is decorated as a pytest fixture."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        is_fixture = (isinstance(target, ast.Attribute) and target.attr == "fixture") or (
            isinstance(target, ast.Name) and target.id == "fixture"
        )
        if not is_fixture:
            continue
        if isinstance(decorator, ast.Call):
            for keyword in decorator.keywords:
                if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                    return str(keyword.value.value)
        return node.name
    return None


def _declaration(tree: ast.Module) -> ast.expr | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == DECLARATION for target in node.targets
        ):
            return node.value
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == DECLARATION
            and node.value is not None
        ):
            return node.value
    return None


def _read_conftest(conftest: Path, shown: str) -> tuple[list[FixtureNeed], list[Problem]]:
    problems: list[Problem] = []
    try:
        tree = ast.parse(conftest.read_text(), filename=str(conftest))
    except SyntaxError as exc:
        return [], [Problem("manifest", shown, f"does not parse: {exc.msg} (line {exc.lineno})")]
    value = _declaration(tree)
    if value is None:
        return [], []
    try:
        declared = ast.literal_eval(value)
    except ValueError:
        return [], [Problem("manifest", shown, f"{DECLARATION} must be a literal dict")]
    if not isinstance(declared, Mapping):
        return [], [Problem("manifest", shown, f"{DECLARATION} must be a dict of fixture name → needs")]
    defined = {
        name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for name in [_fixture_name(node)]
        if name is not None
    }
    needs: list[FixtureNeed] = []
    for name, implies in declared.items():
        subject = f"{shown}: {DECLARATION}[{name!r}]"
        if not isinstance(name, str) or not isinstance(implies, tuple | list):
            problems.append(Problem("manifest", subject, "must map a fixture name to a tuple of base needs"))
            continue
        unknown = [need for need in implies if need not in BASE_NEEDS]
        if unknown:
            problems.append(
                Problem(
                    "manifest",
                    subject,
                    f"implies unknown needs {unknown} (base needs: {', '.join(BASE_NEEDS)})",
                )
            )
            continue
        if name not in defined:
            problems.append(Problem("manifest", subject, "names a fixture this conftest does not define"))
            continue
        needs.append(FixtureNeed(name, tuple(str(need) for need in implies), conftest))
    return needs, problems


def catalog(root: Path, gates_dir: Path) -> tuple[dict[str, FixtureNeed], list[Problem]]:
    """Every declared fixture need on the suite's path; an inner conftest overrides an outer one."""
    found: dict[str, FixtureNeed] = {}
    problems: list[Problem] = []
    for conftest in conftests_for(root, gates_dir):
        shown = str(conftest.relative_to(root)) if conftest.is_relative_to(root) else str(conftest)
        needs, issues = _read_conftest(conftest, shown)
        problems.extend(issues)
        for need in needs:
            found[need.name] = need
    return found, problems
