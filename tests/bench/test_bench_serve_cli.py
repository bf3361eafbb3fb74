"""`infer bench serve` end to end against a real sim server."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest
from bench_support import SimServer
from typer.testing import CliRunner

from infer_cli.bench.loadgen.runner import arrival_delays
from infer_cli.main import app

RUNNER = CliRunner()
TABLE_ROWS = (
    "Successful requests",
    "Request throughput (req/s)",
    "Output token throughput (tok/s)",
    "Total token throughput (tok/s)",
    *(
        f"{stat} {name} (ms)"
        for name in ("TTFT", "TPOT", "ITL", "E2E latency")
        for stat in ("Mean", "Median", "P99")
    ),
)


def _bench(url: str, tmp_path: Path, *extra: str) -> tuple[int, str, dict[str, Any] | None]:
    out = tmp_path / "result.json"
    result = RUNNER.invoke(app, ["bench", "serve", "--base-url", url, "--save-result", str(out), *extra])
    data = json.loads(out.read_text()) if out.exists() else None
    return result.exit_code, result.output, data


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_prints_its_table_and_writes_valid_json(
    sim_server: SimServer, tmp_path: Path, endpoint: str
) -> None:
    sim_server.tracker.reset()
    code, output, data = _bench(
        sim_server.url,
        tmp_path,
        "--endpoint", endpoint,
        "--num-prompts", "24",
        "--max-concurrency", "6",
        "--input-len", "40",
        "--output-len", "12",
        "--seed", "3",
    )  # fmt: skip
    assert code == 0, output
    for row in TABLE_ROWS:
        assert row in output, row
    assert data is not None
    assert (data["completed"], data["failed"]) == (24, 0)
    assert data["model"] == "sim" and data["endpoint"] == endpoint
    # The sim's tokenizer is byte-level, so calibrated prompts are exact, chat template included.
    assert data["input_lens"] == [40] * 24
    assert data["output_lens"] == [12] * 24
    assert data["total_input_tokens"] == 24 * 40
    assert data["total_output_tokens"] == 24 * 12
    assert data["output_len_mismatches"] == 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        mean, median, p99 = (data[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p99"))
        assert all(math.isfinite(x) and x >= 0 for x in (mean, median, p99)), name
        assert p99 >= median, name
    assert data["mean_e2el_ms"] >= data["mean_ttft_ms"]
    assert data["output_throughput"] == pytest.approx(data["total_output_tokens"] / data["duration"])
    assert data["request_throughput"] == pytest.approx(24 / data["duration"])
    # infer serve exports its CPU time and engine step histogram; the bench reads both.
    assert data["server_engine_steps"] > 0
    assert data["server_engine_step_mean_ms"] > 0
    assert data["server_cpu_s"] is not None and data["server_cpu_s"] >= 0
    assert sim_server.tracker.max_open <= 6


def test_request_rate_spreads_the_arrivals(sim_server: SimServer, tmp_path: Path) -> None:
    rate, count, seed = 100.0, 20, 5
    code, output, data = _bench(
        sim_server.url,
        tmp_path,
        "--num-prompts", str(count),
        "--request-rate", str(rate),
        "--seed", str(seed),
        "--input-len", "16",
        "--output-len", "4",
    )  # fmt: skip
    assert code == 0, output
    assert data is not None and data["completed"] == count
    assert data["request_rate"] == rate
    # Requests leave on the Poisson schedule, so the run lasts at least as long as its gaps.
    assert data["duration"] >= sum(arrival_delays(rate, count, seed))


def test_poisson_arrivals_have_the_asked_rate_and_repeat_with_the_seed() -> None:
    delays = arrival_delays(50.0, 4000, seed=9)
    assert sum(delays) / len(delays) == pytest.approx(1 / 50.0, rel=0.06)
    assert all(d >= 0 for d in delays)
    assert delays == arrival_delays(50.0, 4000, seed=9)
    assert delays != arrival_delays(50.0, 4000, seed=10)
    assert arrival_delays(math.inf, 3, seed=9) == [0.0, 0.0, 0.0]


def test_unreachable_server_fails_clearly(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Nothing listens on the port once the socket is closed.
    code, output, data = _bench(f"http://127.0.0.1:{port}", tmp_path, "--num-prompts", "2")
    assert code == 1
    assert "cannot reach" in output
    assert data is None


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    code, output, _ = _bench("http://127.0.0.1:9", tmp_path, "--num-prompts", "0")
    assert code == 2
    assert "--num-prompts" in output
    code, output, _ = _bench("http://127.0.0.1:9", tmp_path, "--request-rate", "0")
    assert code == 2
    assert "--request-rate" in output
