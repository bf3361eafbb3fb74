"""`infer bench kernels` on the CPU: the byte count behind every GB/s figure, and a clear refusal."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from infer_cli.bench.prep_timing import BENCH_VARIANTS, bench_plan, prep_bytes
from infer_cli.main import app

VARIANTS = {variant.label: variant for variant in BENCH_VARIANTS}


@pytest.mark.parametrize(
    ("label", "per_row"),
    [
        # Q 32·128 in and out, K and V 8·128 in and into slots: (2·4096 + 4·1024)·2 bytes,
        # plus cos/sin of 64 pairs (2·64·2) and three int32 indices.
        ("qwen3-4b", (2 * 4096 + 4 * 1024) * 2 + 2 * 64 * 2 + 12),
        # Q arrives as [q | gate] (16·512 in) and leaves as q and gate (2·16·256); K, V 4·256 in
        # and out; 32 rotating pairs.
        ("qwen3.5-4b-full", (16 * 512 + 2 * 16 * 256 + 4 * 4 * 256) * 2 + 2 * 32 * 2 + 12),
        # No V input: K 1·512 in, K and V 1·512 out; 64 rotating pairs.
        ("gemma4-12b-global", (2 * 16 * 512 + 3 * 512) * 2 + 2 * 64 * 2 + 12),
    ],
)
def test_bytes_count_each_input_read_and_each_output_written_once(label: str, per_row: int) -> None:
    variant = VARIANTS[label]
    weights = 2 * variant.spec.head_dim * 2
    assert prep_bytes(variant, 1, torch.bfloat16) == per_row + weights
    assert prep_bytes(variant, 8192, torch.bfloat16) == 8192 * per_row + weights


def test_the_plan_covers_every_variant_at_decode_and_prefill_sizes() -> None:
    plan = bench_plan()
    assert len(plan) == len(BENCH_VARIANTS) * 7
    for variant in BENCH_VARIANTS:
        sizes = [(phase, rows) for v, phase, rows in plan if v is variant]
        assert sizes == [("decode", r) for r in (1, 8, 64, 256)] + [
            ("prefill", r) for r in (2048, 8192, 16384)
        ]


def test_without_a_gpu_the_command_refuses_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["bench", "kernels"])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output
