"""The L2 prefetch of a mixer's output projection (docs/kernels.md, "L2 prefetch of the output
projection"): the kernel builds for sm_90 with its prefetch and both PDL instructions, the step rule
(which token counts prefetch, ``INFER_L2_PREFETCH_ROWS``), and, on a GPU, that a prefetch captured in
a graph changes nothing it points at.

The interpreter cannot run the kernel's inline PTX, so off CUDA ``prefetch_weight`` launches nothing;
the rule is checked by standing the launch in for CUDA.
"""

from __future__ import annotations

import pytest
import torch
from sm90_compile import compiled_variants

from kernels import layer_ops
from kernels.triton import l2_prefetch


def test_the_kernel_compiles_for_sm90_with_its_prefetch_and_pdl() -> None:
    assert compiled_variants("kernels.triton.l2_prefetch") == ["compiled l2_prefetch for sm_90"]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of each step whose prefetch would launch, with the launch standing in for CUDA's."""
    seen: list[int] = []
    monkeypatch.setattr(layer_ops, "_on_triton", lambda x: True)
    monkeypatch.setattr(l2_prefetch, "prefetch_to_l2", lambda weight: seen.append(weight.shape[0]))
    return seen


def test_decode_steps_up_to_max_rows_prefetch_and_larger_steps_do_not(
    launches: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("INFER_L2_PREFETCH_ROWS", raising=False)
    for rows in (0, 1, 8, l2_prefetch.MAX_ROWS, l2_prefetch.MAX_ROWS + 1, 1024):
        layer_ops.prefetch_weight(torch.empty(rows + 1, 4), rows)
    assert launches == [2, 9, l2_prefetch.MAX_ROWS + 1]


@pytest.mark.parametrize(("setting", "expected"), [("0", []), ("8", [2, 9]), ("", [2, 9, 17])])
def test_the_environment_sets_the_largest_step_that_prefetches(
    launches: list[int], monkeypatch: pytest.MonkeyPatch, setting: str, expected: list[int]
) -> None:
    monkeypatch.setattr(l2_prefetch, "MAX_ROWS", 16)
    monkeypatch.setenv("INFER_L2_PREFETCH_ROWS", setting)
    for rows in (1, 8, 16, 17):
        layer_ops.prefetch_weight(torch.empty(rows + 1, 4), rows)
    assert launches == expected


def test_nothing_launches_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(weight: torch.Tensor) -> None:
        raise AssertionError("a prefetch launched off CUDA")

    monkeypatch.setattr(l2_prefetch, "prefetch_to_l2", refuse)
    layer_ops.prefetch_weight(torch.empty(8, 4), 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_a_captured_prefetch_replays_and_leaves_its_weight_as_it_was() -> None:
    weight = torch.randn(2560, 4096 + 3, device="cuda", dtype=torch.bfloat16)  # not a chunk multiple
    before = weight.clone()
    out = torch.empty(8, 2560, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 4096 + 3, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        l2_prefetch.prefetch_to_l2(weight)
        torch.matmul(x, weight.T, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(weight, before)
    assert torch.equal(out, torch.matmul(x, weight.T))
