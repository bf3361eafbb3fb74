"""models.gguf.cache.build_once: a directory is built once, whole, even when asked for at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from models.gguf.cache import build_once


def test_two_callers_at_once_build_one_directory(tmp_path: Path) -> None:
    target = tmp_path / "converted"
    builds: list[str] = []
    started = threading.Barrier(2)

    def build(staging: Path) -> None:
        builds.append(staging.name)
        time.sleep(0.3)  # long enough that the other caller arrives while this one builds
        (staging / "model.safetensors").write_text("whole")

    results: list[Path] = []

    def ask() -> None:
        started.wait()
        results.append(build_once(target, build))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1, builds
    assert results == [target, target]
    assert (target / "model.safetensors").read_text() == "whole"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".converted.partial-")] == []


def test_a_failed_build_leaves_nothing_and_the_next_caller_builds(tmp_path: Path) -> None:
    target = tmp_path / "converted"

    def broken(staging: Path) -> None:
        (staging / "half").write_text("x")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        build_once(target, broken)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []
    assert build_once(target, lambda staging: (staging / "ok").write_text("y")) == target
    assert (target / "ok").read_text() == "y"
