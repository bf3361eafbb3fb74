"""Typed errors of GGUF conversion; each names the file, tensor or field it refused."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from models.registry import ModelLoadError


class GGUFError(ModelLoadError):
    """A GGUF file cannot be converted as asked; the message says why."""


class MissingGGUFDependencyError(GGUFError):
    def __init__(self, package: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the {package!r} package, which is not installed: "
            "pip install 'infer[gguf]' (make install includes it)"
        )
        self.package = package


class GGUFTensorsError(GGUFError):
    """Every tensor of the file that cannot be converted, named at once."""

    def __init__(self, path: Path, problems: Sequence[str]) -> None:
        listing = "\n  ".join(problems)
        super().__init__(f"{path}: {len(problems)} tensor(s) cannot be converted:\n  {listing}")
        self.path = path
        self.problems = tuple(problems)
