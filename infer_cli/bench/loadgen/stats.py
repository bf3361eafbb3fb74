"""Aggregate statistics of a benchmark run, in the units `vllm bench serve` reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from infer_cli.bench.loadgen.client import RequestRecord


@dataclass(frozen=True, slots=True)
class Distribution:
    """Milliseconds."""

    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Distribution:
        if not seconds:
            return cls(float("nan"), float("nan"), float("nan"))
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


_VLLM_NAMES = {"e2e": "e2el", "duration_s": "duration"}


@dataclass(frozen=True, slots=True)
class BenchSummary:
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    # Requests that finished with a different number of output tokens than asked for.
    output_len_mismatches: int

    def to_dict(self) -> dict[str, Any]:
        """Flat, with the key names `vllm bench serve --save-result` uses (`mean_ttft_ms`, ...)."""
        flat: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if isinstance(value, dict):
                for stat, number in value.items():
                    flat[f"{stat}_{_VLLM_NAMES.get(key, key)}_ms"] = number
            else:
                flat[_VLLM_NAMES.get(key, key)] = value
        return flat


def summarize(records: Sequence[RequestRecord], duration_s: float, output_len: int) -> BenchSummary:
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    return BenchSummary(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft=Distribution.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Distribution.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Distribution.of([gap for r in ok for gap in r.chunk_gaps]),
        e2e=Distribution.of([r.e2e for r in ok if r.e2e is not None]),
        output_len_mismatches=sum(1 for r in ok if r.output_tokens != output_len),
    )
