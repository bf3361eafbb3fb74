"""The gates' bounds: tie follows from the stream bound, and on bf16 the stream bound follows the
checkpoint's logits (gates/harness/tolerances.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gates.harness.model_fixtures import checkpoint_tolerance
from gates.harness.serving import batch_scheduler, load_for_gate, top_logit
from gates.harness.tolerances import BF16, FP32, LOGIT_STEPS, bf16_step, for_logits


def test_bf16_step_is_the_spacing_of_bf16_numbers() -> None:
    for value in (1.0, 5.0, -5.0, 7.9, 20.0, 30.0, 0.3):
        step = bf16_step(value)
        x = torch.tensor(abs(value), dtype=torch.float32).to(torch.bfloat16).float()
        # One step up from a bf16 number in the binade is the next bf16 number.
        assert float((x + step).to(torch.bfloat16)) == float(x) + step, value
        assert float((x + step / 4).to(torch.bfloat16)) == float(x), value
    assert bf16_step(5.0) == 2**-5 and bf16_step(20.0) == 2**-3
    with pytest.raises(ValueError, match="value=0"):
        bf16_step(0.0)


def test_tie_is_twice_the_stream_bound() -> None:
    for tol in (FP32, BF16, for_logits(BF16, 20.0)):
        assert tol.tie == 2 * tol.stream_logprob


def test_bf16_bounds_follow_the_logits_binade_and_fp32_stays() -> None:
    assert for_logits(BF16, 5.0) == BF16  # 3 steps of 2^-5 are under the 0.1 floor
    wide = for_logits(BF16, 20.0)
    assert wide.stream_logprob == LOGIT_STEPS * 2**-3 and wide.tie == 2 * LOGIT_STEPS * 2**-3
    assert (wide.mean_abs, wide.p99_abs, wide.max_regret) == (BF16.mean_abs, BF16.p99_abs, BF16.max_regret)
    assert for_logits(FP32, 20.0) == FP32


def test_top_logit_reads_a_fresh_model_and_leaves_it_as_it_was(tiny_qwen3: Path) -> None:
    model = load_for_gate(tiny_qwen3)
    first = top_logit(model)
    assert 0 < first < float("inf")
    assert top_logit(model) == first
    load = batch_scheduler(model).load()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)


def test_checkpoint_tolerance_scales_bf16_only(tiny_qwen3: Path) -> None:
    assert checkpoint_tolerance(torch.float32, tiny_qwen3) is FP32
    # The bf16 branch runs here on the fp32 CPU model: the tiny model's logits are small, so the
    # floor holds; what it reads is the same top_logit the GPU suites read.
    top = top_logit(load_for_gate(tiny_qwen3))
    assert checkpoint_tolerance(torch.bfloat16, tiny_qwen3) == for_logits(BF16, top)
