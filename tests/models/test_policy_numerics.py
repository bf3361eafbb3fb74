"""A `per-token` model is batch-invariant end to end on CPU: the gate body `gates.harness.invariance`
run on tiny checkpoints, without graphs.

`per-token` is the policy checked here because its GEMM is row by row on every device, so its rows
are batch-invariant on CPU too. `invariant`'s Triton GEMM runs under the interpreter on CPU, whose
fp32 `tl.dot` is numpy's matmul: that one gives a row different bits at different positions of a
tile, which the GPU's kernel does not, so the CPU cannot stand in for it (the GPU gate does).
The Triton norm and activation kernels are forced on (the interpreter runs them) so the models'
dispatched calls, fused residual steps included, are what computes each row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kernels.layer_ops as layer_ops
from gates.harness.invariance import (
    InvarianceError,
    TargetRun,
    check_batch_invariance,
    compare_to_alone,
    load_invariant,
)


def _checkpoint(request: pytest.FixtureRequest, family: str) -> Path:
    return Path(request.getfixturevalue(f"tiny_{family}"))


def _vocab_size(checkpoint: Path) -> int:
    config = json.loads((checkpoint / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_per_token_rows_are_bitwise_alone_and_in_batches(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    checkpoint = _checkpoint(request, family)
    calls = {"rms_norm": 0, "add_rms_norm": 0, "gated_activation": 0}

    def on_triton(x: object) -> bool:
        # Count which dispatched entry point the model took; True sends it to the Triton kernel.
        import inspect

        caller = inspect.stack()[1].function
        calls[caller] = calls.get(caller, 0) + 1
        return True

    monkeypatch.setattr(layer_ops, "_on_triton", on_triton)
    model = load_invariant(checkpoint, "per-token", top_bucket=8)
    replayed = check_batch_invariance(model, "per-token", [2, 5], _vocab_size(checkpoint))
    assert replayed == []  # no graphs on CPU: nothing to replay, nothing claimed
    assert all(count > 0 for count in calls.values()), calls


def _run(batch: int, last_logprob: str) -> TargetRun:
    return TargetRun(batch, (5, 9), ((5, "-0x1.0p+0", ((5, "-0x1.0p+0"),)), (9, last_logprob, ())))


def test_one_ulp_or_a_signed_zero_fails_the_comparison() -> None:
    alone = _run(1, "-0x1.0000000000000p+1")
    compare_to_alone(alone, _run(8, "-0x1.0000000000000p+1"), "invariant")
    with pytest.raises(InvarianceError, match="token 1 of the target differs in a batch of 8"):
        compare_to_alone(alone, _run(8, "-0x1.0000000000001p+1"), "invariant")
    with pytest.raises(InvarianceError, match="batch of 4"):
        compare_to_alone(_run(1, (0.0).hex()), _run(4, (-0.0).hex()), "per-token")
