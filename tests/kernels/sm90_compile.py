"""Runs a kernel module's ahead-of-time compile check (``python -m MODULE``) in a child process.

The interpreter accepts programs the GPU compiler rejects, so interpreter tests alone do not show a
kernel builds; each module's ``main`` compiles its variants to sm_90 cubins with the ptxas that
ships with Triton. A child process, because the test session itself interprets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def compiled_variants(module: str) -> list[str]:
    """The module's ``compiled …`` lines; fails the test if the compile check exits non-zero."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [line for line in result.stdout.splitlines() if line.startswith("compiled ")]
