"""Running a benchmark: calibrate prompt sizes, then send the requests on a Poisson schedule under
a concurrency cap, streaming each one, and collect what each measured."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from infer_cli.bench.loadgen.client import (
    Endpoint,
    ProbeError,
    RequestRecord,
    prompt_tokens_of,
    request_body,
    stream_request,
)
from infer_cli.bench.loadgen.prompts import TokenRate, make_prompts, random_text
from infer_cli.bench.loadgen.server_metrics import ServerCost, scrape

# Probe prompt sizes in characters: long enough to average out, short enough for a small context.
_PROBE_CHARS = (48, 144)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str
    endpoint: Endpoint
    input_len: int
    output_len: int
    num_prompts: int
    model: str | None = None
    max_concurrency: int | None = None
    # Requests per second of the Poisson arrival process; inf sends everything at once.
    request_rate: float = math.inf
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency {self.max_concurrency}: must be at least 1")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate {self.request_rate}: must be > 0 (inf: all at once)")


@dataclass(frozen=True, slots=True)
class BenchRun:
    model: str
    rate: TokenRate
    prompt_chars: int
    records: tuple[RequestRecord, ...]
    duration_s: float
    server: ServerCost


def arrival_delays(rate: float, count: int, seed: int) -> list[float]:
    """Gaps before each request: exponential with mean 1/rate (a Poisson process), or all 0."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed ^ 0xA5A5)
    return [rng.expovariate(rate) for _ in range(count)]


def _client(config: BenchConfig) -> httpx.AsyncClient:
    connections = min(config.max_concurrency or config.num_prompts, 4096)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(
        base_url=config.base_url.rstrip("/").removesuffix("/v1"),
        headers=headers,
        timeout=httpx.Timeout(config.timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


async def _resolve_model(client: httpx.AsyncClient, model: str | None) -> str:
    if model is not None:
        return model
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ProbeError(f"cannot reach the server: {exc}") from exc
    if response.status_code != 200:
        raise ProbeError(f"/v1/models answered HTTP {response.status_code}: {response.text[:300]}")
    data = response.json().get("data") or []
    if not data:
        raise ProbeError("/v1/models lists no model; pass --model")
    return str(data[0]["id"])


async def _calibrate(client: httpx.AsyncClient, config: BenchConfig, model: str) -> TokenRate:
    rng = random.Random(config.seed ^ 0x5A5A)
    try:
        tokens = [
            await prompt_tokens_of(client, config.endpoint, model, random_text(rng, chars))
            for chars in _PROBE_CHARS
        ]
    except httpx.HTTPError as exc:
        raise ProbeError(f"cannot reach the server: {exc}") from exc
    return TokenRate.from_probes(_PROBE_CHARS, (tokens[0], tokens[1]))


async def run_benchmark(
    config: BenchConfig, on_done: Callable[[RequestRecord], None] | None = None
) -> BenchRun:
    async with _client(config) as client:
        model = await _resolve_model(client, config.model)
        rate = await _calibrate(client, config, model)
        prompt_chars = rate.chars_for(config.input_len)
        prompts = make_prompts(config.seed, config.num_prompts, prompt_chars)
        delays = arrival_delays(config.request_rate, config.num_prompts, config.seed)
        gate = asyncio.Semaphore(config.max_concurrency or config.num_prompts)

        async def one(prompt: str) -> RequestRecord:
            async with gate:
                record = RequestRecord(prompt_chars=len(prompt))
                body = request_body(config.endpoint, model, prompt, config.output_len)
                await stream_request(client, config.endpoint, body, record)
            if on_done is not None:
                on_done(record)
            return record

        before = await scrape(client)
        started = time.perf_counter()
        tasks: list[asyncio.Task[RequestRecord]] = []
        for prompt, delay in zip(prompts, delays, strict=True):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        after = await scrape(client)
    return BenchRun(model, rate, prompt_chars, tuple(records), duration, ServerCost.between(before, after))
