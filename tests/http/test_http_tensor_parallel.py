"""`infer serve` at `--tensor-parallel-size 2` (the tiny synthetic Qwen3 over two gloo ranks on the
CPU) when a worker dies: the request in flight fails with an error naming the rank, `/health` turns
503 with a one-line OpenAI-shaped error and no traceback, and later requests are refused at once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.parallel.runner import TensorParallelRunner
from engine.scheduler import BatchScheduler
from infer_cli.http.app import ServerSettings, create_app
from infer_cli.http.server import BackgroundServer
from models.registry import ModelOptions, load_model


def test_a_dead_worker_fails_requests_and_health_with_one_line(tiny_qwen3: Path) -> None:
    engine = EngineConfig(num_kv_pages=64, tensor_parallel_size=2, collective_timeout_s=30.0)
    model = load_model(str(tiny_qwen3), ModelOptions(engine=engine, device="cpu"))
    assert isinstance(model.scheduler, BatchScheduler)
    runner = model.scheduler.runner
    assert isinstance(runner, TensorParallelRunner)
    body = {"prompt": "the quick brown fox", "max_tokens": 4, "ignore_eos": True}
    try:
        with BackgroundServer(create_app(model, ServerSettings(served_model_name="tp"))) as server:
            url = server.base_url
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            assert httpx.get(f"{url}/health").status_code == 200

            (pid,) = runner.worker_pids()
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            started = time.monotonic()
            failed = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert failed.status_code == 500
            message = failed.json()["error"]["message"]
            assert "tensor-parallel worker rank 1 exited with code -9" in message and "\n" not in message

            health = httpx.get(f"{url}/health")
            assert health.status_code == 503
            error = health.json()["error"]
            assert error["message"] == (
                "driver stopped: WorkerDiedError: tensor-parallel worker rank 1 exited with code -9"
            )
            assert (error["type"], error["code"]) == ("service_unavailable_error", "engine_unhealthy")
            assert "Traceback" not in health.text

            refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
            assert time.monotonic() - started < 10.0
    finally:
        runner.close()
