"""Fixtures for the `infer bench serve` tests: a real sim server on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bench_support import ConcurrencyTracker, SimServer

from infer_cli.http.app import ServerSettings, create_app
from infer_cli.http.server import BackgroundServer
from models.registry import LoadedModel
from models.sim import SimOptions, build_sim

# Each engine step sleeps this long, as a forward would take: an instant sim can finish a whole
# completion before the client reads it, and the server then sends it in one chunk (no inter-token
# gaps for the ITL figures to measure; seen under a loaded CPU).
SIM_STEP_DELAY_S = 0.005


@pytest.fixture(scope="module")
def sim_server() -> Iterator[SimServer]:
    model = build_sim(SimOptions(step_delay_s=SIM_STEP_DELAY_S))
    tracker = ConcurrencyTracker(model.scheduler)
    tracked = LoadedModel(model.name, tracker, model.tokenizer, model.max_model_len)
    with BackgroundServer(create_app(tracked, ServerSettings(served_model_name="sim"))) as server:
        yield SimServer(server.base_url, tracker)
