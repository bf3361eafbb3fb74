"""The arrows between packages (docs/layers.md), read off every import statement in the tree:
`kernels` imports none of ours; `engine` imports only `kernels`; `models` imports `engine` and
`kernels`; nothing imports `infer_cli`; and only `infer_cli` and the gate runner draw with rich."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("engine", "kernels", "models", "gates", "infer_cli")
# Per package, what it must not import (its own top-level package is always allowed).
FORBIDDEN: dict[str, frozenset[str]] = {
    "kernels": frozenset({"engine", "models", "gates", "infer_cli", "rich"}),
    "engine": frozenset({"models", "gates", "infer_cli", "rich"}),
    "models": frozenset({"gates", "infer_cli", "rich"}),
    "gates": frozenset({"infer_cli"}),
}


@dataclass(frozen=True, slots=True)
class Import:
    path: Path
    line: int
    module: str

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.module}"


def imports_of(path: Path) -> list[Import]:
    """Every absolute import in a file, module-level or not (a lazy import is still an arrow)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend(Import(path, node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(Import(path, node.lineno, node.module))
    return found


def violations(package: str, root: Path = ROOT) -> list[Import]:
    forbidden = FORBIDDEN[package]
    return [
        imp
        for path in sorted((root / package).rglob("*.py"))
        for imp in imports_of(path)
        if imp.top in forbidden and not _is_gate_runner_drawing(path, imp, root)
    ]


def _is_gate_runner_drawing(path: Path, imp: Import, root: Path) -> bool:
    # The gate runner draws its own progress and tables (it is an interface, like infer_cli).
    return imp.top == "rich" and path.is_relative_to(root / "gates" / "runner")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    bad = violations(package)
    assert not bad, "imports against the arrows:\n  " + "\n  ".join(map(str, bad))


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    # A lazy import inside a function of engine/ (the form the arrows were broken in before).
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "bench.py").write_text(
        "def sweep():\n    from models.registry import load_model\n    import rich.progress\n"
    )
    found = sorted(imp.module for imp in violations("engine", tmp_path))
    assert found == ["models.registry", "rich.progress"]


def test_every_package_is_read() -> None:
    for package in OURS:
        assert any((ROOT / package).rglob("*.py")), f"{package}/ holds no Python file"
