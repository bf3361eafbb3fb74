"""Helpers for the HTTP tests: a real uvicorn server on a free loopback port over a real sim engine,
and a spy scheduler that records what the driver thread told it and what it answered."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai

from engine.async_engine import AsyncEngine
from engine.contract import Load, Request, Scheduler, StepOutputs
from infer_cli.http.app import ServerSettings, create_app, server_state
from infer_cli.http.server import BackgroundServer
from models.registry import LoadedModel
from models.sim import FaultHook, SimOptions, build_sim


@dataclass
class LiveServer:
    model: LoadedModel
    server: BackgroundServer
    engine: AsyncEngine
    api_key: str | None

    @property
    def url(self) -> str:
        return self.server.base_url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=60
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120
        )

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def wait_idle(self, timeout: float = 20.0) -> Load:
        """The load the driver publishes, once nothing runs or waits any more."""
        deadline = time.monotonic() + timeout
        while True:
            load = self.engine.load
            if (load.running, load.waiting) == (0, 0) and self.engine.counters.open_streams == 0:
                return load
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy after {timeout} s: {load}")
            time.sleep(0.01)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics, read over HTTP like a Prometheus scrape."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return read_metric(text, name, **labels)


def read_metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    raise KeyError(f"{name} {labels} not in /metrics")


@contextmanager
def live_server(
    *,
    options: SimOptions | None = None,
    fault: FaultHook | None = None,
    api_key: str | None = None,
    served_model_name: str = "sim",
    max_body_bytes: int = 4 * 1024 * 1024,
    wrap_scheduler: Callable[[Scheduler], Scheduler] | None = None,
) -> Iterator[LiveServer]:
    model = build_sim(options or SimOptions(), fault=fault)
    if wrap_scheduler is not None:
        model = LoadedModel(model.name, wrap_scheduler(model.scheduler), model.tokenizer, model.max_model_len)
    app = create_app(
        model,
        ServerSettings(served_model_name=served_model_name, api_key=api_key, max_body_bytes=max_body_bytes),
    )
    with BackgroundServer(app) as server:
        yield LiveServer(model=model, server=server, engine=server_state(app).engine, api_key=api_key)


class SpyScheduler:
    """Delegates to a real scheduler and records, on the driver thread, what it was told and what it
    said: every abort (with KV pages in use just before and just after it) and every step's output."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        # (request_id, pages_before, pages_after, running_before, running_after)
        self.aborts: list[tuple[str, int, int, int, int]] = []
        # Per step: (index of the step, ids that got tokens, ids that got a terminal)
        self.steps: list[tuple[int, frozenset[str], frozenset[str]]] = []
        self.abort_step: dict[str, int] = {}
        self.submitted: list[Request] = []
        self.die = False

    def submit(self, request: Request) -> None:
        with self.lock:
            self.submitted.append(request)
        self.inner.submit(request)

    def abort(self, request_id: str) -> None:
        before = self.inner.load()
        self.inner.abort(request_id)
        after = self.inner.load()
        with self.lock:
            self.aborts.append(
                (request_id, before.kv_pages_used, after.kv_pages_used, before.running, after.running)
            )
            self.abort_step.setdefault(request_id, len(self.steps))

    def step(self) -> StepOutputs:
        if self.die:
            raise RuntimeError("injected fatal step error")
        outputs = self.inner.step()
        self._record(outputs)
        return outputs

    def fail_step(self, message: str) -> StepOutputs:
        if self.die:
            raise RuntimeError("injected fatal: the scheduler cannot recover")
        outputs = self.inner.fail_step(message)
        self._record(outputs)
        return outputs

    def _record(self, outputs: StepOutputs) -> None:
        with self.lock:
            tokens = frozenset(u.request_id for u in outputs.updates if u.new_token_ids)
            ends = frozenset(u.request_id for u in outputs.updates if u.terminal is not None)
            self.steps.append((len(self.steps), tokens, ends))

    def load(self) -> Load:
        return self.inner.load()

    def has_work(self) -> bool:
        return self.inner.has_work()


@contextmanager
def spied_server(
    options: SimOptions | None = None, fault: FaultHook | None = None
) -> Iterator[tuple[LiveServer, SpyScheduler]]:
    """A live server whose scheduler is wrapped in a `SpyScheduler`."""
    spies: list[SpyScheduler] = []

    def wrap(inner: Scheduler) -> Scheduler:
        spies.append(SpyScheduler(inner))
        return spies[-1]

    with live_server(options=options, fault=fault, wrap_scheduler=wrap) as live:
        yield live, spies[0]
