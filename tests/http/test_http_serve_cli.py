"""`infer serve` as a user runs it: a subprocess that prints its URL once listening."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
from typer.testing import CliRunner

from infer_cli.main import app

REPO = Path(__file__).resolve().parents[2]
URL = re.compile(r"(http://127\.0\.0\.1:\d+)/v1")


@contextmanager
def _infer_serve(*args: str) -> Iterator[tuple[str, str]]:
    """The server's base URL and the line that announced it."""
    command = [sys.executable, "-m", "infer_cli.main", "serve", "--port", "0", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "40"}  # narrow: the line must not wrap
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = URL.search(line)
        assert match, f"no URL in {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield match.group(1), line
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_infer_serve_prints_its_url_and_serves_the_flags_it_was_given() -> None:
    started = time.monotonic()
    with _infer_serve(
        "--model", "sim",
        "--served-model-name", "tiny-sim",
        "--api-key", "k3y",
        "--max-model-len", "128",
        "--max-num-seqs", "4",
        "--num-kv-pages", "64",
        "--no-enable-prefix-caching",
        "--sim-step-delay", "0.001",
    ) as (url, announced):  # fmt: skip
        assert time.monotonic() - started < 60
        assert "(max_model_len 128, async scheduling)" in announced, announced
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0)
        result = client.completions.create(
            model="tiny-sim", prompt="hello", max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert result.usage is not None and result.usage.completion_tokens == 8
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k3y"}).json()
        assert models["data"][0]["id"] == "tiny-sim"
        assert models["data"][0]["max_model_len"] == 128
        too_long = httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": "Bearer k3y"},
            json={"prompt": "x" * 100, "max_tokens": 29},
        )
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        metrics = httpx.get(f"{url}/metrics").text
        assert 'infer:kv_pages_total{model_name="tiny-sim"} 63.0' in metrics
        # Prefix caching off: the same prompt twice reports nothing cached.
        again = client.completions.create(model="tiny-sim", prompt="hello" * 8, max_tokens=2)
        again = client.completions.create(model="tiny-sim", prompt="hello" * 8, max_tokens=2)
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_infer_serve_refuses_an_unknown_model() -> None:
    result = CliRunner().invoke(app, ["serve", "--model", "no-such-model", "--port", "0"])
    assert result.exit_code == 2
    assert "no-such-model" in result.output


def test_infer_serve_refuses_bad_engine_knobs() -> None:
    result = CliRunner().invoke(app, ["serve", "--model", "sim", "--max-num-seqs", "0", "--port", "0"])
    assert result.exit_code == 2
    assert "max_num_seqs" in result.output


def test_infer_serve_reports_a_taken_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--model", "sim", "--port", str(port)])
    assert result.exit_code == 1
    assert f"could not serve on 127.0.0.1:{port}" in result.output
