"""Turn `--manifest NAME|PATH` into a manifest file.

A PATH (anything ending in .toml or naming a folder) is taken as given. A NAME is looked up as
manifests/NAME.toml under the current directory, then under the checkout this runner is
installed from, so `infer gates --manifest kernels` works from anywhere in a development tree.
"""

from __future__ import annotations

from pathlib import Path

from gates.runner.problems import GateRunError, Problem


def _repo_root() -> Path:
    # gates/runner/locate.py → the checkout's root.
    return Path(__file__).resolve().parents[2]


def search_dirs(cwd: Path) -> list[Path]:
    dirs = [cwd / "manifests", _repo_root() / "manifests"]
    unique: list[Path] = []
    for folder in dirs:
        if folder.resolve() not in {d.resolve() for d in unique}:
            unique.append(folder)
    return unique


def available(cwd: Path) -> list[str]:
    names: set[str] = set()
    for folder in search_dirs(cwd):
        if folder.is_dir():
            names.update(path.stem for path in folder.glob("*.toml"))
    return sorted(names)


def locate_manifest(spec: str, cwd: Path | None = None) -> Path:
    here = cwd or Path.cwd()
    if spec.endswith(".toml") or "/" in spec or "\\" in spec:
        path = Path(spec)
        path = path if path.is_absolute() else here / path
        if not path.is_file():
            raise GateRunError("manifest", [Problem("manifest", spec, f"no manifest file at {path}")])
        return path
    for folder in search_dirs(here):
        candidate = folder / f"{spec}.toml"
        if candidate.is_file():
            return candidate
    searched = ", ".join(str(folder) for folder in search_dirs(here))
    known = ", ".join(available(here)) or "none"
    raise GateRunError(
        "manifest",
        [Problem("manifest", spec, f"no manifest named {spec} in {searched} (available: {known})")],
    )
