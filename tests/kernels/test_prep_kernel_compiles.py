"""The prep kernel builds for the H200 (sm_90) at every serving shape, checked without a GPU.

The interpreter accepts programs the GPU compiler rejects, so the interpreter tests alone do not
show the kernel builds. ``python -m kernels.triton.aot`` compiles each variant down to a cubin with
the ptxas that ships with Triton; it runs in a child process because this session interprets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kernels.triton.aot import SERVING_VARIANTS

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_variant_compiles_for_sm90() -> None:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "kernels.triton.aot"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == len(SERVING_VARIANTS), result.stdout
