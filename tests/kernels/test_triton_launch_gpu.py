"""FastLaunch on the GPU: the launcher path gives the dispatch path's bits, and replays in a graph.

The CPU side (which calls reuse a compiled kernel) is test_triton_launch.py. Here the RMSNorm, a
kernel every served model launches, runs through a fresh FastLaunch so the first call of each
specialization is Triton's dispatch and the repeats are the launcher's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels.reference import NormSpec, NormWeight
from kernels.triton import invariant_rmsnorm
from kernels.triton.invariant_rmsnorm import invariant_rms_norm
from kernels.triton.launch import FastLaunch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SPEC = NormSpec(NormWeight.W)
ROWS, HIDDEN = 64, 2560  # Qwen3-4B's hidden size


@pytest.fixture
def dispatches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A fresh launcher for the RMSNorm, and a count of the calls that went through Triton's dispatch."""
    kernel = invariant_rmsnorm._invariant_rmsnorm_kernel
    count: list[int] = []
    dispatch: Callable[..., Any] = kernel.run

    def counted(*args: Any, **kwargs: Any) -> Any:
        count.append(1)
        return dispatch(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted)
    monkeypatch.setattr(invariant_rmsnorm, "_invariant_rmsnorm_launch", FastLaunch(kernel))
    return count


def test_the_launcher_path_gives_the_dispatch_path_s_bits(dispatches: list[int]) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    storage = torch.randn(ROWS * HIDDEN + 8, generator=g, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    aligned = storage[: ROWS * HIDDEN].view(ROWS, HIDDEN)
    misaligned = storage[1 : 1 + ROWS * HIDDEN].view(ROWS, HIDDEN)  # 2 bytes past a 16-byte boundary
    first, again = invariant_rms_norm(aligned, SPEC, weight), invariant_rms_norm(aligned, SPEC, weight)
    shifted, shifted_again = (
        invariant_rms_norm(misaligned, SPEC, weight),
        invariant_rms_norm(misaligned, SPEC, weight),
    )
    assert len(dispatches) == 2, "each specialization dispatched once, each repeat launched directly"
    assert torch.equal(first, again) and torch.equal(shifted, shifted_again)
    # The unaligned specialization computes the same bits as the aligned one on the same values.
    assert torch.equal(shifted, invariant_rms_norm(misaligned.clone(), SPEC, weight))


def test_a_launch_captured_in_a_cuda_graph_replays_on_new_values(dispatches: list[int]) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(ROWS, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(2):  # the dispatch, then the launcher: the capture below records the launcher's
        invariant_rms_norm(x, SPEC, weight, out=y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        invariant_rms_norm(x, SPEC, weight, out=y)
    assert len(dispatches) == 1
    x.copy_(torch.randn(ROWS, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, invariant_rms_norm(x.clone(), SPEC, weight))
