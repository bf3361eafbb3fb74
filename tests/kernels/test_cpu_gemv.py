"""kernels/gemm/cpu_gemv.CpuLinear against the spec (F.linear, kernels/reference.py `linear`).

The column-major path sums K in another order than F.linear's row-major one, so both are held to
fp64: the fast path's error may be at most 4x the spec's own fp32 error measured in the same call
(seen: 0.5-2x)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from kernels.gemm.cpu_gemv import CpuLinear
from kernels.reference import linear

N, K = 4096, 640


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max())


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_a_few_rows_take_the_column_major_copy_within_the_spec_bound(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, K, generator=gen), torch.randn(N, K, generator=gen)
    fast = CpuLinear(min_bytes=0)
    got = fast(x, w)
    assert len(fast._column_major) == 1, "the copy was not made"
    want = F.linear(x.double(), w.double())
    spec = linear(x, w)
    assert _err(got, want) <= 4 * _err(spec, want), (_err(got, want), _err(spec, want))
    assert torch.equal(fast(x, w), got), "two runs differ"


def test_more_rows_small_weights_and_other_dtypes_are_f_linear_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(N, K, generator=gen)
    fast = CpuLinear(min_bytes=0)
    x = torch.randn(4, K, generator=gen)
    assert torch.equal(fast(x, w), F.linear(x, w))
    small = CpuLinear(min_bytes=N * K * 4 + 1)
    one = torch.randn(1, K, generator=gen)
    assert torch.equal(small(one, w), F.linear(one, w))
    assert not fast._column_major and not small._column_major


def test_the_copy_goes_with_its_weight() -> None:
    fast = CpuLinear(min_bytes=0)
    w = torch.randn(N, K)
    fast(torch.randn(1, K), w)
    assert len(fast._column_major) == 1
    del w
    gc.collect()
    assert not fast._column_major
