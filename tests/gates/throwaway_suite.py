"""Throwaway gate suites for the runner's tests: a root folder with manifests/NAME.toml and a
gates folder of pytest modules, written per test under tmp_path.

Gates written by `marking_gate` touch a file when they execute, so a test can show that a run
stopped before executing anything.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, Sequence):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML spelling for {value!r}")


def gate_entry(
    gate_id: str, test: str, *, needs: Sequence[str] = (), invariant: str = "kv", **extra: Any
) -> dict[str, Any]:
    return {
        "id": gate_id,
        "test": test,
        "invariant": invariant,
        "needs": list(needs),
        "why": "a test gate",
        **extra,
    }


@dataclass
class ThrowawaySuite:
    root: Path
    name: str = "demo"
    gates_dir: str = "suite_gates"

    @property
    def folder(self) -> Path:
        return self.root / self.gates_dir

    @property
    def manifest(self) -> Path:
        return self.root / "manifests" / f"{self.name}.toml"

    @property
    def executed_marker(self) -> Path:
        return self.root / "executed"

    def write_module(self, filename: str, source: str) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / filename).write_text(textwrap.dedent(source))
        return f"{self.gates_dir}/{filename}"

    def marking_gate(self, filename: str, test_name: str, body: str = "assert True") -> str:
        """A module with one test that records its execution, then runs `body`."""
        marker = str(self.executed_marker)
        module = self.write_module(
            filename,
            f"""
            import pathlib

            def {test_name}():
                with pathlib.Path({marker!r}).open("a") as f:
                    f.write("{test_name}\\n")
                {body}
            """,
        )
        return f"{module}::{test_name}"

    def write_manifest(
        self,
        gates: Sequence[Mapping[str, Any]],
        *,
        model_types: Sequence[str] = (),
        suite_extra: Mapping[str, Any] | None = None,
        top_extra: str = "",
    ) -> Path:
        lines = [
            "[suite]",
            f"name = {toml_value(self.name)}",
            f"model_types = {toml_value(list(model_types))}",
        ]
        lines.append(f"gates_dir = {toml_value(self.gates_dir)}")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in (suite_extra or {}).items())
        for gate in gates:
            lines.extend(["", "[[gate]]"])
            lines.extend(f"{key} = {toml_value(value)}" for key, value in gate.items())
        self.manifest.parent.mkdir(parents=True, exist_ok=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.manifest.write_text("\n".join(lines) + "\n" + top_extra)
        return self.manifest

    def executed(self) -> list[str]:
        if not self.executed_marker.exists():
            return []
        return self.executed_marker.read_text().split()


def fake_checkpoint(folder: Path, model_type: str, text_model_type: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"model_type": model_type}
    if text_model_type is not None:
        config["text_config"] = {"model_type": text_model_type}
    import json

    (folder / "config.json").write_text(json.dumps(config))
    return folder
