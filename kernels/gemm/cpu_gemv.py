"""`tuned` on the CPU: F.linear, except a few rows against a weight far larger than the caches.

MKL streams a row-major [N, K] fp32 weight at about 10 GB/s when it multiplies one row by it, and
the same weight stored column-major ([K, N] contiguous, handed to F.linear as its transpose) at
about 18 GB/s; from four rows up the row-major layout is the faster one. Measured on the 2-core
CI machine, 2026-12-03, Gemma 3's 262,144 × 640 LM head: 70 vs 36 ms at one row, 162 vs 87 ms at
two, 141 vs 222 ms at four (docs/kernels.md, "CPU"). Weights below `COLUMN_MAJOR_MIN_BYTES` stay
cache-resident across a step's rows and gain nothing.

The column-major copy is made once per weight, on first use, and lives as long as the weight: for
a tied LM head it is a second copy of the embedding (+671 MB on Gemma 3 270M in fp32). Results
are F.linear's up to the order of the K-sum (the spec: kernels/reference.py `linear`); `tuned`
promises no batch invariance, so the layout may follow the row count.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

COLUMN_MAJOR_MIN_BYTES = 64 << 20
COLUMN_MAJOR_MAX_ROWS = 3


class CpuLinear:
    def __init__(
        self, min_bytes: int = COLUMN_MAJOR_MIN_BYTES, max_rows: int = COLUMN_MAJOR_MAX_ROWS
    ) -> None:
        self._min_bytes = min_bytes
        self._max_rows = max_rows
        # id(weight) → (a weak reference to it, its column-major copy); the entry goes with the weight.
        self._column_major: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if (
            rows > self._max_rows
            or x.device.type != "cpu"
            or weight.dim() != 2
            or weight.numel() * weight.element_size() < self._min_bytes
        ):
            return F.linear(x, weight)
        key = id(weight)
        entry = self._column_major.get(key)
        if entry is None or entry[0]() is not weight:
            # [N, K] values in [K, N] storage: F.linear then runs MKL's GEMM over a contiguous B.
            ref = weakref.ref(weight, lambda _: self._column_major.pop(key, None))
            entry = (ref, weight.t().contiguous().t())
            self._column_major[key] = entry
        return F.linear(x, entry[1])
