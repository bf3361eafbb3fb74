"""Fixtures every model suite shares: the serving dtype and its tolerances, a fresh infer load per
gate, and transformers beside it at the serving dtype and in fp32. A suite's conftest imports them
(pytest finds fixtures by name in a conftest's namespace)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gates.harness.hf_reference import hf_model
from gates.harness.serving import gate_device, load_for_gate, top_logit
from gates.harness.tolerances import Tolerance, for_logits, tolerance_for
from models.registry import LoadedModel


@pytest.fixture(scope="session")
def serving_dtype() -> torch.dtype:
    return torch.bfloat16 if gate_device().type == "cuda" else torch.float32


def checkpoint_tolerance(serving_dtype: torch.dtype, checkpoint: Path) -> Tolerance:
    """The serving dtype's bounds; on bf16, scaled to the checkpoint's logits (tolerances.for_logits),
    read from a throwaway eager load that shares the gate process's weights."""
    base = tolerance_for(serving_dtype)
    if serving_dtype == torch.float32:
        return base
    model = load_for_gate(checkpoint, enforce_eager=True)
    top = top_logit(model)
    del model
    gc.collect()  # its KV pool (gigabytes at real dimensions) must be gone before the gates load theirs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    scaled = for_logits(base, top)
    print(f"largest |logit| {top:.3g}: stream bound {scaled.stream_logprob:.3g}, tie {scaled.tie:.3g}")
    return scaled


@pytest.fixture(scope="session")
def tol(serving_dtype: torch.dtype, checkpoint_path: Path) -> Tolerance:
    return checkpoint_tolerance(serving_dtype, checkpoint_path)


@pytest.fixture()
def served(checkpoint_path: Path) -> Iterator[LoadedModel]:
    """A fresh load per gate: no prefix cache or pages carried over from another gate."""
    model = load_for_gate(checkpoint_path)
    yield model
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def hf(checkpoint_path: Path, serving_dtype: torch.dtype) -> Any:
    """transformers at infer's serving dtype."""
    return hf_model(checkpoint_path, gate_device(), serving_dtype)


@pytest.fixture(scope="session")
def hf_fp32(checkpoint_path: Path, serving_dtype: torch.dtype, hf: Any) -> Any:
    """transformers in fp32: the reference both infer and `hf` are measured against."""
    if serving_dtype == torch.float32:
        return hf
    return hf_model(checkpoint_path, gate_device(), torch.float32)
