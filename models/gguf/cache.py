"""Converted GGUF files, kept under the infer cache so a file converts once.

A file's directory is named by its resolved path, size and mtime (a file rewritten in place
converts again) and by `FORMAT`, the version of what a conversion writes. A conversion goes to a
staging directory beside it and is renamed into place when complete, so a directory that exists
is whole. Two processes that ask for the same directory at once take turns on a lock file beside
it, so one converts and the other finds the result.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from engine.progress import SILENT, ProgressSink
from models.gguf.convert import convert_gguf

CACHE_ENV = "INFER_CACHE"
# Bumped whenever the converted directory would differ for the same file.
FORMAT = "1"


def cache_root() -> Path:
    """$INFER_CACHE/gguf, else ~/.cache/infer/gguf."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    base = Path(raw).expanduser() if raw else Path.home() / ".cache" / "infer"
    return base / "gguf"


def build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """`target` if it exists; else `build(staging)` then rename the staging directory to `target`."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if target.is_dir():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        try:
            build(staging)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def cache_dir_for(path: Path) -> Path:
    resolved = path.resolve()
    stat = resolved.stat()
    key = hashlib.sha256(f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0{FORMAT}".encode()).hexdigest()
    return cache_root() / f"{resolved.stem}-{key[:16]}"


def converted_checkpoint(path: Path, progress: ProgressSink = SILENT) -> Path:
    """The checkpoint directory of GGUF file `path`, converted on first use."""
    target = cache_dir_for(path)
    if not target.is_dir():
        progress.note(f"{path.name}: converting once into {target}")
    return build_once(target, lambda staging: convert_gguf(path, staging, overwrite=True, progress=progress))
