"""Fixtures every gate suite shares, and the rule that a gate never skips.

- `checkpoint_path`: the checkpoint folder from INFER_TEST_CHECKPOINT (the runner sets it from
  --checkpoint). Unset, missing, or without config.json: the gate FAILS, it does not skip.
- `checkpoint_config`: that checkpoint's parsed config.json.
- `cuda_device`: the first CUDA device; none: the gate fails.

GATE_FIXTURE_NEEDS declares these fixtures as named needs a manifest may list, with the base
needs each implies (see docs/gates.md). A skip or xfail inside any gate under gates/ is turned
into a failure here as well as by the runner's plugin, so a plain `pytest gates/...` obeys the
same rule as `infer gates`.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gates.runner.plugin_path.infer_gate_plugin import fail_instead_of_skip

if TYPE_CHECKING:
    import torch

CHECKPOINT_ENV = "INFER_TEST_CHECKPOINT"

GATE_FIXTURE_NEEDS = {
    "checkpoint_path": ("checkpoint",),
    "checkpoint_config": ("checkpoint",),
    "cuda_device": ("gpu",),
}


@pytest.fixture(scope="session")
def checkpoint_path() -> Path:
    raw = os.environ.get(CHECKPOINT_ENV, "").strip()
    if not raw:
        pytest.fail(
            f"{CHECKPOINT_ENV} is not set: this gate needs a checkpoint (infer gates --checkpoint PATH)",
            pytrace=False,
        )
    path = Path(raw).expanduser()
    if not path.is_dir():
        pytest.fail(f"{CHECKPOINT_ENV}={raw}: no such checkpoint folder", pytrace=False)
    if not (path / "config.json").is_file():
        pytest.fail(f"{CHECKPOINT_ENV}={raw}: the folder has no config.json", pytrace=False)
    return path


@pytest.fixture(scope="session")
def checkpoint_config(checkpoint_path: Path) -> dict[str, Any]:
    config_path = checkpoint_path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        pytest.fail(f"{config_path} does not parse: {exc}", pytrace=False)
    if not isinstance(config, dict):
        pytest.fail(f"{config_path} is not a JSON object", pytrace=False)
    return config


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    import torch

    if not torch.cuda.is_available():
        pytest.fail(
            "no CUDA device: this gate needs a GPU (torch.cuda.is_available() is False)", pytrace=False
        )
    return torch.device("cuda", 0)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    fail_instead_of_skip(report, "this gate")
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """When gates share one process: say a failure's reason as it happens (a long run is often cut
    off before pytest's summary), and drop the traceback pytest keeps for post-mortem debugging,
    whose frames would otherwise hold the failed gate's engine, and its device memory, into the next
    gate."""
    if not report.failed:
        return
    print(
        f"\n[gate failed] {report.nodeid} ({report.when}):\n{report.longreprtext[-4000:]}",
        file=sys.__stderr__,
    )
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None
    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()
