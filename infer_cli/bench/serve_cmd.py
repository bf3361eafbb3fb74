"""`infer bench serve`: a load generator against any OpenAI-compatible server, like `vllm bench serve`.

Random prompts of `--input-len` tokens ask for exactly `--output-len` tokens (`ignore_eos`), streamed;
the run reports request and token throughput and mean / median / p99 of TTFT, TPOT, ITL and E2E.
"""

from __future__ import annotations

import asyncio
import json
import math
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from infer_cli.bench.loadgen.client import Endpoint, ProbeError, RequestRecord
from infer_cli.bench.loadgen.prompts import PromptSizeError
from infer_cli.bench.loadgen.runner import BenchConfig, BenchRun, run_benchmark
from infer_cli.bench.loadgen.stats import BenchSummary, Distribution, summarize

_console = Console()
_errors = Console(stderr=True)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def _table(config: BenchConfig, run: BenchRun, summary: BenchSummary) -> Table:
    table = Table(title=f"Serving benchmark: {run.model} at {config.base_url} ({config.endpoint.value})")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def row(name: str, value: str) -> None:
        table.add_row(name, value)

    concurrency = "unlimited" if config.max_concurrency is None else str(config.max_concurrency)
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    row("Max concurrency / request rate (req/s)", f"{concurrency} / {rate}")
    row("Successful requests", str(summary.completed))
    row("Failed requests", str(summary.failed))
    row("Benchmark duration (s)", f"{summary.duration_s:.2f}")
    row("Total input tokens", str(summary.total_input_tokens))
    row("Total generated tokens", str(summary.total_output_tokens))
    if summary.output_len_mismatches:
        row("Requests not of --output-len tokens", str(summary.output_len_mismatches))
    row("Request throughput (req/s)", f"{summary.request_throughput:.2f}")
    row("Output token throughput (tok/s)", f"{summary.output_throughput:.2f}")
    row("Total token throughput (tok/s)", f"{summary.total_token_throughput:.2f}")
    metrics: list[tuple[str, Distribution]] = [
        ("TTFT", summary.ttft),
        ("TPOT", summary.tpot),
        ("ITL", summary.itl),
        ("E2E latency", summary.e2e),
    ]
    server = run.server
    if server.cpu_s is not None and summary.total_output_tokens:
        row("Server CPU per output token (us)", f"{server.cpu_s / summary.total_output_tokens * 1e6:.1f}")
    if server.engine_step_mean_s is not None:
        row("Server mean engine step (ms)", f"{server.engine_step_mean_s * 1e3:.3f}")
    for name, dist in metrics:
        table.add_section()
        row(f"Mean {name} (ms)", f"{dist.mean:.2f}")
        row(f"Median {name} (ms)", f"{dist.median:.2f}")
        row(f"P99 {name} (ms)", f"{dist.p99:.2f}")
    return table


def _result_json(config: BenchConfig, run: BenchRun, summary: BenchSummary) -> dict[str, Any]:
    ok = [r for r in run.records if r.success]
    errors = sorted({r.error for r in run.records if r.error})
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "machine": f"{platform.node()} ({platform.machine()}, {platform.system()})",
        "base_url": config.base_url,
        "endpoint": config.endpoint.value,
        "model": run.model,
        "num_prompts": config.num_prompts,
        "input_len": config.input_len,
        "output_len": config.output_len,
        "max_concurrency": config.max_concurrency,
        "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
        "seed": config.seed,
        "prompt_chars": run.prompt_chars,
        "tokens_per_char": run.rate.per_char,
        **summary.to_dict(),
        "server_cpu_s": run.server.cpu_s,
        "server_cpu_per_output_token_us": (
            run.server.cpu_s / summary.total_output_tokens * 1e6
            if run.server.cpu_s is not None and summary.total_output_tokens
            else None
        ),
        "server_engine_steps": run.server.engine_steps,
        "server_engine_step_mean_ms": (
            run.server.engine_step_mean_s * 1e3 if run.server.engine_step_mean_s is not None else None
        ),
        "errors": errors[:20],
        "input_lens": [r.prompt_tokens for r in ok],
        "output_lens": [r.output_tokens for r in ok],
        "ttfts": [r.ttft for r in ok],
        "e2els": [r.e2e for r in ok],
    }


def bench_serve_command(
    base_url: str = typer.Option(
        "http://127.0.0.1:8000", "--base-url", help="Server root (with or without /v1)."
    ),
    model: str | None = typer.Option(
        None, "--model", help="Model name to send (default: the server's first)."
    ),
    endpoint: Endpoint = typer.Option(Endpoint.COMPLETIONS, "--endpoint", help="completions or chat."),
    input_len: int = typer.Option(1024, "--input-len", help="Prompt length in tokens."),
    output_len: int = typer.Option(128, "--output-len", help="Tokens to generate per request (ignore_eos)."),
    num_prompts: int = typer.Option(1000, "--num-prompts", help="Requests to send."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", help="Most requests in flight."),
    request_rate: float = typer.Option(
        math.inf, "--request-rate", help="Poisson arrival rate in requests/s; inf sends all at once."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompts and the arrival times."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Bearer token."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds one request may take."),
    save_result: Path | None = typer.Option(None, "--save-result", help="Write the results as JSON here."),
) -> None:
    try:
        config = BenchConfig(
            base_url=base_url,
            endpoint=endpoint,
            input_len=input_len,
            output_len=output_len,
            num_prompts=num_prompts,
            model=model,
            max_concurrency=max_concurrency,
            request_rate=request_rate,
            seed=seed,
            api_key=api_key,
            timeout_s=timeout,
        )
    except ValueError as exc:
        _errors.print(f"[red]infer bench serve:[/red] {exc}")
        raise typer.Exit(2) from None

    progress = Progress(
        TextColumn("[bold]requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        console=_errors,
    )
    task = progress.add_task("requests", total=num_prompts, failed=0)
    failed = 0

    def on_done(record: RequestRecord) -> None:
        nonlocal failed
        failed += not record.success
        progress.update(task, advance=1, failed=failed)

    try:
        with progress:
            run = asyncio.run(run_benchmark(config, on_done))
    except (ProbeError, PromptSizeError, ValueError) as exc:
        _errors.print(f"[red]infer bench serve:[/red] {exc}")
        raise typer.Exit(1) from None

    summary = summarize(run.records, run.duration_s, output_len)
    _console.print(_table(config, run, summary))
    errors = sorted({r.error for r in run.records if r.error})
    for error in errors[:5]:
        _errors.print(f"[yellow]error:[/yellow] {error}")
    if save_result is not None:
        save_result.parent.mkdir(parents=True, exist_ok=True)
        save_result.write_text(json.dumps(_result_json(config, run, summary), indent=2) + "\n")
        _errors.print(f"results written to {save_result}")
    if summary.completed == 0:
        raise typer.Exit(1)
