"""Fixtures for the HTTP tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from http_support import LiveServer, live_server


@pytest.fixture(scope="module")
def sim_server() -> Iterator[LiveServer]:
    with live_server() as live:
        yield live
