"""The gates' bounds: tie follows from the stream bound, and on bf16 the stream bound follows the
checkpoint's logits (gates/harness/tolerances.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gates.harness.compare import LogprobDelta, assert_parity
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
    assert for_logits(BF16, 3.0) == BF16  # 6 steps of 2^-6 are under the 0.1 floor
    assert for_logits(BF16, 5.0).stream_logprob == LOGIT_STEPS * 2**-5 > BF16.stream_logprob
    wide = for_logits(BF16, 20.0)
    assert wide.stream_logprob == LOGIT_STEPS * 2**-3 and wide.tie == 2 * LOGIT_STEPS * 2**-3
    assert (wide.mean_abs, wide.p99_abs) == (BF16.mean_abs, BF16.p99_abs)
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


def _delta(mean: float, p99: float, regret: float) -> LogprobDelta:
    return LogprobDelta(
        positions=3078,
        mean_abs=mean,
        p99_abs=p99,
        max_abs=0.2,
        argmax_agreement=0.94,
        max_regret=regret,
        top5_membership=1.0,
    )


def test_max_regret_is_bounded_by_twice_the_p99_bound() -> None:
    # The H200 Gemma 4 12B figures of 2026-12-03 (tolerances.py): infer no worse than transformers
    # bf16 in mean and p99, 1.30x in max regret, under 2 x 1.25 x 0.108.
    transformers_bf16 = _delta(0.0320, 0.108, 0.152)
    assert_parity(_delta(0.0317, 0.105, 0.197), transformers_bf16, BF16)
    with pytest.raises(AssertionError, match=r"max regret over 0\.27"):
        assert_parity(_delta(0.0317, 0.105, 0.28), transformers_bf16, BF16)
    with pytest.raises(AssertionError, match="p99"):
        assert_parity(_delta(0.0317, 0.14, 0.197), transformers_bf16, BF16)
    # fp32: absolute bounds, the regret one twice the p99 floor.
    assert_parity(_delta(1e-6, 1e-5, 2e-3), None, FP32)
    with pytest.raises(AssertionError, match=r"max regret over 0\.002"):
        assert_parity(_delta(1e-6, 1e-5, 2.1e-3), None, FP32)
