"""`infer bench gdn` on a machine without a GPU, and the arithmetic its floors rest on."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from infer_cli.bench.gdn_timing import GEOMETRIES, moved_bytes, prefill_flops, varlen_lengths
from infer_cli.main import app


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU sees")
def test_refuses_without_a_gpu_by_name() -> None:
    result = CliRunner().invoke(app, ["bench", "gdn"])
    assert result.exit_code == 2
    assert "infer bench gdn needs a CUDA GPU" in result.output


def test_varlen_lengths_are_unequal_and_sum_to_the_total() -> None:
    for total in (1024, 8192, 32768, 9):
        lengths = varlen_lengths(total)
        assert len(lengths) == 8 and sum(lengths) == total and min(lengths) >= 1
    assert len(set(varlen_lengths(1024))) == 8


def test_floors_at_the_4b_geometry() -> None:
    """Per value head and token, 2·(3·64·128 + 2·64·128 + 3·128·128) = 180,224 FLOPs; a decode row
    moves its 32 × 128 × 128 fp32 state in and out (4 MiB) plus its token's q, k, v, o, g, β."""
    geo = GEOMETRIES["4b"]
    assert prefill_flops(geo, 1) == 32 * 180_224
    token = 2 * (2 * 16 * 128 + 2 * 32 * 128) + 4 * 32 + 2 * 32
    assert moved_bytes(geo, 1, 1, torch.bfloat16) == token + 2 * 4 * 32 * 128 * 128
