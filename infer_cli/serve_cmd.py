"""`infer serve`: load a model and serve it over the OpenAI-compatible HTTP API.

One process, one event loop, one driver thread. Engine knobs are spelled as vLLM spells them so a
vLLM command line carries over.
"""

from __future__ import annotations

import asyncio
import logging
from enum import StrEnum

import typer
from rich.console import Console

from engine.config import EngineConfig
from engine.contract import ContractError
from engine.memory_budget import MemoryBudgetError
from infer_cli.http.app import ServerSettings, create_app
from infer_cli.http.body import DEFAULT_MAX_BODY_BYTES
from infer_cli.http.server import ServerStartError, serve
from infer_cli.progress import RichProgress
from models.checkpoint import WeightsError
from models.config_fields import ConfigError
from models.context_limit import OPT_IN_ENV
from models.registry import ModelLoadError, ModelOptions, load_model


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


_console = Console(stderr=True)
# The URL goes to stdout so scripts can read it; progress and errors go to stderr.
_stdout = Console()


def _engine_config(
    max_model_len: int | None,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    num_kv_pages: int | None,
    enable_prefix_caching: bool,
    enforce_eager: bool = False,
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory: int | None = None,
    numeric_policy: str = "tuned",
    allow_long_max_model_len: bool = False,
    async_prefill: bool = False,
) -> EngineConfig:
    defaults = EngineConfig()
    return EngineConfig(
        max_num_seqs=max_num_seqs if max_num_seqs is not None else defaults.max_num_seqs,
        max_num_batched_tokens=(
            max_num_batched_tokens if max_num_batched_tokens is not None else defaults.max_num_batched_tokens
        ),
        max_model_len=max_model_len,
        num_kv_pages=num_kv_pages,
        enable_prefix_caching=enable_prefix_caching,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory=kv_cache_memory,
        numeric_policy=numeric_policy,
        allow_long_max_model_len=allow_long_max_model_len,
        async_prefill=async_prefill,
    )


def serve_command(
    model: str = typer.Option("sim", "--model", help="'sim' or a Hugging Face checkpoint directory."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8000, "--port", help="Port to bind (0: any free port)."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="INFER_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*."
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", help="Context length (default: the model's max_position_embeddings)."
    ),
    allow_long_max_model_len: bool = typer.Option(
        False,
        "--allow-long-max-model-len",
        envvar=OPT_IN_ENV,
        help="Allow --max-model-len above the model's max_position_embeddings (vLLM's "
        f"VLLM_ALLOW_LONG_MAX_MODEL_LEN; env {OPT_IN_ENV}=1). Outputs past it may degrade.",
    ),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model name clients send and see (default: the model's)."
    ),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="Most requests running at once."),
    max_num_batched_tokens: int | None = typer.Option(
        None, "--max-num-batched-tokens", help="Token budget of one engine step."
    ),
    num_kv_pages: int | None = typer.Option(
        None,
        "--num-kv-pages",
        help="KV pages (16 tokens) per full-attention group; sliding groups get what they need (default: measured).",
    ),
    enable_prefix_caching: bool = typer.Option(
        True, "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse KV of shared prompt prefixes."
    ),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Decode without CUDA graphs."),
    async_prefill: bool = typer.Option(
        False,
        "--async-prefill",
        help="Prefill new requests on a second CUDA stream while decode steps continue; they join at a later step.",
    ),
    gpu_memory_utilization: float = typer.Option(
        0.9,
        "--gpu-memory-utilization",
        help="Fraction of GPU memory for weights, activations, graphs and KV.",
    ),
    kv_cache_memory: int | None = typer.Option(
        None, "--kv-cache-memory", help="KV-cache size in bytes, overriding the measured budget."
    ),
    numeric_policy: str = typer.Option(
        "tuned",
        "--numeric-policy",
        help="GEMM numerics: tuned (cuBLAS), pin, per-token (diagnostic oracle) or invariant (batch-invariant).",
    ),
    sim_step_delay: float = typer.Option(
        0.0, "--sim-step-delay", help="sim only: seconds each engine step sleeps, standing in for a forward."
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="Weight and activation dtype (model lines)."),
    device: str | None = typer.Option(None, "--device", help="Device to run on, e.g. cuda or cpu."),
    attention_backend: str | None = typer.Option(None, "--attention-backend", help="torch or flashinfer."),
    max_request_bytes: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES, "--max-request-bytes", help="Largest request body accepted (413 above)."
    ),
    log_level: LogLevel = typer.Option(LogLevel.WARNING, "--log-level", help="uvicorn and infer log level."),
) -> None:
    logging.basicConfig(
        level=log_level.value.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine = _engine_config(
            max_model_len,
            max_num_seqs,
            max_num_batched_tokens,
            num_kv_pages,
            enable_prefix_caching,
            enforce_eager,
            gpu_memory_utilization,
            kv_cache_memory,
            numeric_policy,
            allow_long_max_model_len,
            async_prefill,
        )
        options = ModelOptions(
            engine=engine,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            sim_step_delay_s=sim_step_delay,
            progress=RichProgress(_console),
        )
        _console.print(f"infer serve: loading {model}")
        loaded = load_model(model, options)
    except (ContractError, ModelLoadError, ConfigError, WeightsError, MemoryBudgetError) as exc:
        _console.print(f"[red]infer serve:[/red] {exc}")
        raise typer.Exit(2) from None
    if max_request_bytes < 1024:
        _console.print(
            f"[red]infer serve:[/red] --max-request-bytes {max_request_bytes}: must be at least 1024"
        )
        raise typer.Exit(2)

    name = served_model_name or loaded.name
    app = create_app(
        loaded, ServerSettings(served_model_name=name, api_key=api_key, max_body_bytes=max_request_bytes)
    )

    def announce(bound_port: int) -> None:
        shown_host = f"[{host}]" if ":" in host else host
        _stdout.print(
            f"infer: serving [bold]{name}[/bold] (max_model_len {loaded.max_model_len}) at "
            f"[bold]http://{shown_host}:{bound_port}/v1[/bold]"
        )

    try:
        asyncio.run(serve(app, host, port, announce, log_level=log_level.value))
    except ServerStartError as exc:
        _console.print(f"[red]infer serve:[/red] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
