"""Fixtures for the sampler tests."""

from __future__ import annotations

import pytest
import torch

# Every test runs on the CPU; on a machine with CUDA the same tests run there too.
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)
