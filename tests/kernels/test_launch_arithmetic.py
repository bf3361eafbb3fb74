"""The launch wrappers' host arithmetic: `ceil_div` and `next_power_of_2` give Triton's own
`triton.cdiv` / `triton.next_power_of_2` (each ~2 µs a call from Python, ~0.1 µs for these)."""

from __future__ import annotations

import triton

from kernels.kv_layout import ceil_div
from kernels.triton.storage import next_power_of_2


def test_next_power_of_2_is_tritons() -> None:
    for n in (*range(1, 4097), 65_535, 65_536, 65_537, 151_936, 262_144, 262_145):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_ceil_div_is_tritons_cdiv() -> None:
    for numerator in (*range(0, 300), 151_936, 262_145):
        for denominator in (1, 2, 3, 16, 64, 128, 1000):
            assert ceil_div(numerator, denominator) == triton.cdiv(numerator, denominator), (
                numerator,
                denominator,
            )
