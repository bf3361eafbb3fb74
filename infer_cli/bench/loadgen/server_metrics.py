"""What the server says about its own cost, read from its Prometheus /metrics before and after a run.

Optional by design: a server without /metrics, or without these series, simply reports nothing.
`process_cpu_seconds_total` is exported by vLLM and by `infer serve`; the engine step histogram
is `infer serve`'s own and is what the frontend-overhead benchmark subtracts from TPOT.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

_CPU = "process_cpu_seconds_total"
_STEP_SUM = "infer:engine_step_duration_seconds_sum"
_STEP_COUNT = "infer:engine_step_duration_seconds_count"


def parse_totals(text: str) -> dict[str, float]:
    """The wanted series, summed over their label sets."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name in (_CPU, _STEP_SUM, _STEP_COUNT):
            try:
                totals[name] = totals.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return totals


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    return parse_totals(response.text)


@dataclass(frozen=True, slots=True)
class ServerCost:
    """Deltas over the run; None where the server does not export the series."""

    cpu_s: float | None
    engine_steps: int | None
    engine_step_mean_s: float | None

    @classmethod
    def between(cls, before: dict[str, float], after: dict[str, float]) -> ServerCost:
        def delta(name: str) -> float | None:
            if name in before and name in after:
                return after[name] - before[name]
            return None

        cpu = delta(_CPU)
        steps = delta(_STEP_COUNT)
        step_sum = delta(_STEP_SUM)
        mean = step_sum / steps if steps and step_sum is not None else None
        return cls(cpu, int(steps) if steps is not None else None, mean)
