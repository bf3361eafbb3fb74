"""Prometheus metrics under vLLM's names, so dashboards and KV-aware routers built for vLLM read them.

Each app owns its registry (tests build many apps in one process). Gauges of the engine's load are
refreshed when /metrics is scraped rather than on every step: a scrape is rare, a step is not.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from engine.contract import Load

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; dense where a healthy server lives, sparse out to pathological tails.
# fmt: off
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03,
                 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
                60.0, 120.0, 300.0, 600.0, 1800.0)
# fmt: on


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=r)

        self._running = gauge("vllm:num_requests_running", "Requests admitted and being generated.").labels(
            model_name
        )
        self._waiting = gauge("vllm:num_requests_waiting", "Requests submitted and not yet admitted.").labels(
            model_name
        )
        self._kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full)."
        ).labels(model_name)
        self._kv_used = gauge("infer:kv_pages_used", "KV-cache pages held by requests.").labels(model_name)
        self._kv_total = gauge("infer:kv_pages_total", "KV-cache pages in all.").labels(model_name)
        self._prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.").labels(
            model_name
        )
        self._generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(model_name)
        self._success = Counter(
            "vllm:request_success",
            "Requests that ended, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._errors = Counter(
            "infer:request_errors",
            "Requests answered with an error after reaching the engine, by kind.",
            ["model_name", "kind"],
            registry=r,
        )
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival to first generated token.",
            label,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive deliveries of new tokens.",
            label,
            buckets=_ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to the request's end.",
            label,
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        # The engine's own time per step, next to the latencies clients see: the difference is the
        # frontend's cost. Observed on the driver thread (prometheus_client is thread-safe).
        self._step = Histogram(
            "infer:engine_step_duration_seconds",
            "Wall time of one engine step, measured around Scheduler.step on the driver thread.",
            label,
            buckets=_STEP_BUCKETS,
            registry=r,
        ).labels(model_name)
        # process_cpu_seconds_total and friends, as vLLM exposes them: CPU per output token.
        ProcessCollector(registry=r)
        self._queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Submission to admission.",
            label,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)

    # -- recorded by request handlers ----------------------------------------------------------

    def admitted(self, prompt_tokens: int, queue_seconds: float) -> None:
        self._prompt_tokens.inc(prompt_tokens)
        self._queue.observe(max(queue_seconds, 0.0))

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def tokens(self, count: int, since_previous: float | None) -> None:
        self._generation_tokens.inc(count)
        if since_previous is not None:
            self._itl.observe(since_previous)

    def ended(self, finished_reason: str, e2e_seconds: float) -> None:
        self._success.labels(self.model_name, finished_reason).inc()
        self._e2e.observe(e2e_seconds)

    def engine_step(self, seconds: float) -> None:
        self._step.observe(seconds)

    def errored(self, kind: str) -> None:
        self._errors.labels(self.model_name, kind).inc()

    # -- scrape --------------------------------------------------------------------------------

    def render(self, load: Load) -> bytes:
        self._running.set(load.running)
        self._waiting.set(load.waiting)
        self._kv_usage.set(load.kv_usage)
        self._kv_used.set(load.kv_pages_used)
        self._kv_total.set(load.kv_pages_total)
        return generate_latest(self.registry)
