"""The gate runner behind `infer gates`: manifest schema and validator, membership through pytest
collection, preflight of needs, serial execution (one pytest process per gate, or one shared
process with `--shared-process`), JSON and JUnit reports. See docs/gates.md.
"""

from __future__ import annotations

from gates.runner.execution import GateOutcome
from gates.runner.locate import locate_manifest
from gates.runner.manifest import Gate, Manifest, Suite, load_manifest
from gates.runner.needs import BASE_NEEDS, INVARIANTS, TIERS, Tier
from gates.runner.problems import GateRunError, Problem
from gates.runner.reports import RunReport, write_json, write_junit
from gates.runner.session import Observer, RunOptions, run_manifest

__all__ = [
    "BASE_NEEDS",
    "INVARIANTS",
    "TIERS",
    "Gate",
    "GateOutcome",
    "GateRunError",
    "Manifest",
    "Observer",
    "Problem",
    "RunOptions",
    "RunReport",
    "Suite",
    "Tier",
    "load_manifest",
    "locate_manifest",
    "run_manifest",
    "write_json",
    "write_junit",
]
