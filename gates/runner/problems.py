"""A problem that stops a gate run before any gate executes, named for the person reading it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Stage = Literal["manifest", "membership", "selection", "preflight"]


@dataclass(slots=True, frozen=True)
class Problem:
    stage: Stage
    # What the problem is about: a gate id, a test node, a need, a key of the manifest.
    subject: str
    message: str

    def __str__(self) -> str:
        return f"{self.subject}: {self.message}"


class GateRunError(Exception):
    """Problems found at one stage; every one of them, not just the first."""

    def __init__(self, stage: Stage, problems: list[Problem]) -> None:
        super().__init__(f"{len(problems)} {stage} problem(s): " + "; ".join(str(p) for p in problems))
        self.stage = stage
        self.problems = problems
