"""A suite's manifest (manifests/NAME.toml): the schema, the loader and the validator.

    [suite]
    name = "kernels"
    model_types = []               # model types the suite accepts; [] needs no checkpoint
    gates_dir = "gates/kernels"

    [[gate]]
    id = "kernels.prep_matches_spec"             # `<suite name>.<snake_case>`, stable
    test = "gates/kernels/test_prep.py::test_x"  # pytest node id from the suite root
    invariant = "numeric-parity"
    needs = ["gpu"]                              # base needs and declared fixture needs
    timeout_s = 300                              # optional
    isolated = true                              # optional: own process even under --shared-process
    why = "one line"

Paths: the suite root is the folder above `manifests/` when the manifest lives in a folder of
that name (the repository layout), else the manifest's own folder. `gates_dir` and every `test`
are relative to the suite root; `gates_dir` may be absolute but must lie inside the root, since
pytest names tests relative to it. The validator reports every problem at once.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gates.runner.fixture_needs import FixtureNeed, catalog
from gates.runner.needs import BASE_NEEDS, GPUS_PREFIX, INVARIANTS, is_base_need
from gates.runner.problems import GateRunError, Problem

DEFAULT_TIMEOUT_S = 900
MAX_TIMEOUT_S = 24 * 3600
_SUITE_KEYS = ("name", "model_types", "gates_dir")
_GATE_KEYS = ("id", "test", "invariant", "needs", "timeout_s", "isolated", "why")
_TOP_KEYS = ("suite", "gate")
_ID_PART = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@dataclass(slots=True, frozen=True)
class Suite:
    name: str
    model_types: tuple[str, ...]
    root: Path
    gates_dir: Path

    @property
    def gates_dir_shown(self) -> str:
        return str(self.gates_dir.relative_to(self.root))


@dataclass(slots=True, frozen=True)
class Gate:
    id: str
    test: str
    invariant: str
    needs: tuple[str, ...]
    timeout_s: int
    why: str
    # Runs in a process of its own even when the run shares one (`--shared-process`): for gates
    # that measure the device, which other gates' models would share.
    isolated: bool = False


@dataclass(slots=True, frozen=True)
class Manifest:
    path: Path
    suite: Suite
    gates: tuple[Gate, ...]
    fixture_needs: Mapping[str, FixtureNeed]

    def base_needs(self, gate: Gate) -> frozenset[str]:
        """The gate's needs with each named fixture replaced by the base needs it implies."""
        base: set[str] = set()
        for need in gate.needs:
            if is_base_need(need):
                base.add(need)
            else:
                base.update(self.fixture_needs[need].implies)
        return frozenset(base)


def suite_root(manifest_path: Path) -> Path:
    folder = manifest_path.resolve().parent
    return folder.parent if folder.name == "manifests" else folder


def _check_keys(
    table: Mapping[str, Any], allowed: tuple[str, ...], where: str, problems: list[Problem]
) -> None:
    for key in table:
        if key not in allowed:
            problems.append(
                Problem("manifest", where, f"unknown key {key!r} (allowed: {', '.join(allowed)})")
            )


def _suite(raw: Any, root: Path, problems: list[Problem]) -> Suite | None:
    if not isinstance(raw, Mapping):
        problems.append(Problem("manifest", "[suite]", "missing: the manifest needs a [suite] table"))
        return None
    _check_keys(raw, _SUITE_KEYS, "[suite]", problems)
    name = raw.get("name")
    if not isinstance(name, str) or not _ID_PART.match(name):
        problems.append(Problem("manifest", "[suite].name", f"must be a lower-case name, got {name!r}"))
        name = None
    model_types = raw.get("model_types")
    if not isinstance(model_types, list) or not all(isinstance(t, str) and t for t in model_types):
        problems.append(
            Problem(
                "manifest",
                "[suite].model_types",
                f"must be a list of model types ([] if none), got {model_types!r}",
            )
        )
        model_types = None
    gates_dir_raw = raw.get("gates_dir")
    gates_dir: Path | None = None
    if not isinstance(gates_dir_raw, str) or not gates_dir_raw:
        problems.append(
            Problem("manifest", "[suite].gates_dir", f"must be a folder path, got {gates_dir_raw!r}")
        )
    else:
        gates_dir = (root / gates_dir_raw).resolve()
        if not gates_dir.is_relative_to(root):
            problems.append(
                Problem("manifest", "[suite].gates_dir", f"{gates_dir} lies outside the suite root {root}")
            )
            gates_dir = None
        elif not gates_dir.is_dir():
            problems.append(
                Problem("manifest", "[suite].gates_dir", f"{gates_dir_raw} is not a folder under {root}")
            )
            gates_dir = None
    if name is None or model_types is None or gates_dir is None:
        return None
    return Suite(name=name, model_types=tuple(model_types), root=root, gates_dir=gates_dir)


def _gate(
    raw: Any,
    index: int,
    suite: Suite | None,
    fixtures: Mapping[str, FixtureNeed],
    problems: list[Problem],
) -> Gate | None:
    where = f"[[gate]] #{index + 1}"
    if not isinstance(raw, Mapping):
        problems.append(Problem("manifest", where, "must be a table"))
        return None
    gate_id = raw.get("id")
    if isinstance(gate_id, str):
        where = f"gate {gate_id}"
    _check_keys(raw, _GATE_KEYS, where, problems)
    start = len(problems)

    if not isinstance(gate_id, str) or not all(_ID_PART.match(part) for part in gate_id.split(".")):
        problems.append(Problem("manifest", where, f"id must be dotted lower-case names, got {gate_id!r}"))
    elif suite is not None and not gate_id.startswith(f"{suite.name}."):
        problems.append(Problem("manifest", where, f"id must start with the suite name: {suite.name}.<name>"))

    test = raw.get("test")
    if not isinstance(test, str) or "::" not in test:
        problems.append(
            Problem("manifest", where, f"test must be a pytest node id (path.py::name), got {test!r}")
        )
    else:
        test_path = PurePosixPath(test.split("::", 1)[0])
        if test_path.is_absolute() or ".." in test_path.parts or test_path.suffix != ".py":
            problems.append(
                Problem("manifest", where, f"test path {test_path} must be a .py file under the suite root")
            )
        elif suite is not None and not (suite.root / test_path).resolve().is_relative_to(suite.gates_dir):
            problems.append(
                Problem(
                    "manifest", where, f"test {test} lies outside the suite folder {suite.gates_dir_shown}"
                )
            )

    invariant = raw.get("invariant")
    if invariant not in INVARIANTS:
        problems.append(
            Problem("manifest", where, f"unknown invariant {invariant!r} (known: {', '.join(INVARIANTS)})")
        )

    needs = raw.get("needs")
    if not isinstance(needs, list) or not all(isinstance(need, str) for need in needs):
        problems.append(
            Problem("manifest", where, f"needs must be a list of names ([] if none), got {needs!r}")
        )
        needs = []
    for need in needs:
        if not is_base_need(need) and need not in fixtures:
            named = ", ".join(sorted(fixtures)) or "none declared"
            problems.append(
                Problem(
                    "manifest",
                    where,
                    f"unknown need {need!r} (base needs: {', '.join(BASE_NEEDS)}, {GPUS_PREFIX}N with N ≥ 1; "
                    f"named fixtures: {named})",
                )
            )
    for need in {n for n in needs if needs.count(n) > 1}:
        problems.append(Problem("manifest", where, f"need {need!r} is listed twice"))

    timeout = raw.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 0 < timeout <= MAX_TIMEOUT_S:
        problems.append(
            Problem(
                "manifest", where, f"timeout_s must be whole seconds in 1..{MAX_TIMEOUT_S}, got {timeout!r}"
            )
        )

    isolated = raw.get("isolated", False)
    if not isinstance(isolated, bool):
        problems.append(Problem("manifest", where, f"isolated must be true or false, got {isolated!r}"))

    why = raw.get("why")
    if not isinstance(why, str) or not why.strip() or "\n" in why.strip():
        problems.append(Problem("manifest", where, f"why must be one non-empty line, got {why!r}"))

    if len(problems) > start:
        return None
    assert (
        isinstance(gate_id, str)
        and isinstance(test, str)
        and isinstance(invariant, str)
        and isinstance(why, str)
    )
    return Gate(gate_id, test, invariant, tuple(needs), int(timeout), why.strip(), isolated)


def _duplicates(gates: list[Any], problems: list[Problem]) -> None:
    for key, label in (("id", "id"), ("test", "test node")):
        seen: dict[str, int] = {}
        for index, raw in enumerate(gates):
            value = raw.get(key) if isinstance(raw, Mapping) else None
            if not isinstance(value, str):
                continue
            if value in seen:
                problems.append(
                    Problem(
                        "manifest", value, f"duplicate {label}: [[gate]] #{seen[value] + 1} and #{index + 1}"
                    )
                )
            else:
                seen[value] = index


def load_manifest(path: Path) -> Manifest:
    """Parse and validate; raises GateRunError naming every problem."""
    path = path.resolve()
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise GateRunError(
            "manifest", [Problem("manifest", str(path), f"cannot read: {exc.strerror}")]
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise GateRunError("manifest", [Problem("manifest", str(path), f"is not valid TOML: {exc}")]) from exc

    problems: list[Problem] = []
    _check_keys(data, _TOP_KEYS, "manifest", problems)
    root = suite_root(path)
    suite = _suite(data.get("suite"), root, problems)
    fixtures: dict[str, FixtureNeed] = {}
    if suite is not None:
        fixtures, fixture_problems = catalog(suite.root, suite.gates_dir)
        problems.extend(fixture_problems)

    raw_gates = data.get("gate", [])
    if not isinstance(raw_gates, list):
        problems.append(Problem("manifest", "[[gate]]", "gates must be an array of tables ([[gate]])"))
        raw_gates = []
    _duplicates(raw_gates, problems)
    gates = [_gate(raw, index, suite, fixtures, problems) for index, raw in enumerate(raw_gates)]

    if suite is not None and not suite.model_types:
        for gate in gates:
            if gate is None:
                continue
            implied = {
                n for need in gate.needs for n in ((need,) if is_base_need(need) else fixtures[need].implies)
            }
            if "checkpoint" in implied:
                problems.append(
                    Problem(
                        "manifest", f"gate {gate.id}", "needs a checkpoint but [suite].model_types is empty"
                    )
                )
    if problems:
        raise GateRunError("manifest", problems)
    assert suite is not None
    return Manifest(
        path=path, suite=suite, gates=tuple(g for g in gates if g is not None), fixture_needs=fixtures
    )
