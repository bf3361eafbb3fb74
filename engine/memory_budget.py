"""How many KV pages fit: budget = utilisation × device memory − weights − other resident memory −
activation peak − graphs. Every term is measured on the device by start-up (engine.paged_startup;
docs/engine.md says how); on CPU there is nothing to measure and a fixed KV allowance is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("infer.memory")

GIB = 1 << 30
CPU_KV_BYTES = 1 * GIB


class MemoryBudgetError(RuntimeError):
    """The configuration cannot fit on the device; the message says what does."""


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    total: int
    utilization: float
    weights: int
    activation_peak: int
    graphs: int
    # Device memory in use when the pool is sized, beyond the weights: the margin promised to
    # everything else on the device is what utilisation leaves after it too.
    other_resident: int = 0

    @property
    def kv_bytes(self) -> int:
        return (
            int(self.total * self.utilization)
            - self.weights
            - self.activation_peak
            - self.graphs
            - self.other_resident
        )

    def pages(self, bytes_per_page: int) -> int:
        if self.kv_bytes < 2 * bytes_per_page:
            raise MemoryBudgetError(
                f"no room for the KV cache: {self.utilization:.2f} × {self.total / GIB:.1f} GiB − weights "
                f"{self.weights / GIB:.2f} GiB − activations {self.activation_peak / GIB:.2f} GiB − graphs "
                f"{self.graphs / GIB:.2f} GiB − other resident {self.other_resident / GIB:.2f} GiB = "
                f"{self.kv_bytes / GIB:.2f} GiB"
            )
        return self.kv_bytes // bytes_per_page

    def describe(self, pages: int, page_size: int) -> str:
        return (
            f"KV cache: {pages} pages ({pages * page_size} tokens), {self.kv_bytes / GIB:.2f} GiB; weights "
            f"{self.weights / GIB:.2f} GiB, activation peak {self.activation_peak / GIB:.2f} GiB, graphs took "
            f"{self.graphs / GIB:.2f} GiB, other resident {self.other_resident / GIB:.2f} GiB "
            f"(utilisation {self.utilization:.2f} of {self.total / GIB:.1f} GiB)"
        )
