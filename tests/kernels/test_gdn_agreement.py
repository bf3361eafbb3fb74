"""The agreement check's own rules (kernels/gdn/agreement.py): TF32 rounding, and which unit a
backend is held to by what it declares about its fp32 dots."""

from __future__ import annotations

import torch

from kernels.gdn import GDNGeometry
from kernels.gdn.agreement import (
    FP32_RATIO,
    LOW_RATIO,
    TF32_RATIO,
    AgreementCase,
    AgreementRun,
    round_to_tf32,
)
from kernels.gdn.torch_backend import TorchGDN

GEOMETRY = GDNGeometry(key_heads=2, value_heads=4, key_dim=32, value_dim=32)
LENGTHS = (1, 63, 65)


def test_tf32_rounding_keeps_ten_mantissa_bits_nearest_even() -> None:
    ulp = 2.0**-10
    x = torch.tensor(
        [1.0, 1.0 + ulp / 2, 1.0 + 3 * ulp / 2, 1.0 + ulp / 2 + 2**-20, -(1.0 + 3 * ulp / 2), 3.0]
    )
    want = torch.tensor([1.0, 1.0, 1.0 + 2 * ulp, 1.0 + ulp, -(1.0 + 2 * ulp), 3.0])
    assert torch.equal(round_to_tf32(x), want)
    y = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    rel = ((round_to_tf32(y) - y).abs() / y.abs()).max()
    assert 0 < rel <= 2.0**-11
    assert torch.equal(round_to_tf32(round_to_tf32(y)), round_to_tf32(y))


class _Tf32Torch(TorchGDN):
    fp32_dots = "tf32"


def test_a_tf32_backend_is_held_to_the_tf32_unit_in_fp32_only() -> None:
    fp32 = AgreementRun(
        AgreementCase(GEOMETRY, LENGTHS, len(LENGTHS), True, torch.float32), torch.device("cpu")
    )
    plain, tf32 = TorchGDN(), _Tf32Torch()
    assert fp32.bounds_for(plain) == (
        fp32.spec_out,
        fp32.spec_state,
        FP32_RATIO * fp32.spec_out,
        FP32_RATIO * fp32.spec_state,
    )
    unit_out, unit_state, bound_out, bound_state = fp32.bounds_for(tf32)
    # One TF32 rounding of q̂ and k̂ costs far more than the spec's fp32 error.
    assert unit_out > 100 * fp32.spec_out and unit_state > 100 * fp32.spec_state
    assert (bound_out, bound_state) == (TF32_RATIO * unit_out, TF32_RATIO * unit_state)
    # The torch backend computes in fp32: it passes the tight bound, so the looser one as well.
    assert fp32.check(plain).passed and fp32.check(tf32).passed
    low = AgreementRun(
        AgreementCase(GEOMETRY, LENGTHS, len(LENGTHS), True, torch.bfloat16), torch.device("cpu")
    )
    assert low.bounds_for(tf32) == low.bounds_for(plain)
    assert low.bound_out == LOW_RATIO * low.unit_out
