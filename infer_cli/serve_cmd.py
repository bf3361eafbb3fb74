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

from engine.contract import ContractError
from engine.memory_budget import MemoryBudgetError
from engine.parallel.sharding import ShardError
from infer_cli.engine_options import Knobs, knob_options
from infer_cli.http.app import ServerSettings, create_app
from infer_cli.http.body import DEFAULT_MAX_BODY_BYTES
from infer_cli.http.server import ServerStartError, serve
from infer_cli.progress import RichProgress
from models.checkpoint import WeightsError
from models.config_fields import ConfigError
from models.registry import DEFAULT_MODEL, ModelLoadError, load_model


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


_console = Console(stderr=True)
# The URL goes to stdout so scripts can read it; progress and errors go to stderr.
_stdout = Console()


# Every engine and model knob (infer_cli.engine_options) follows the options written here.
@knob_options()
def serve_command(
    model: str = typer.Option(
        DEFAULT_MODEL,
        "--model",
        help=f"'{DEFAULT_MODEL}' (the embedded Gemma 3 270M, converted on first use), 'sim' (the fake "
        "model), a Hugging Face checkpoint directory, a hub id or a GGUF file.",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8000, "--port", help="Port to bind (0: any free port)."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="INFER_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*."
    ),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model name clients send and see (default: the model's)."
    ),
    max_request_bytes: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES, "--max-request-bytes", help="Largest request body accepted (413 above)."
    ),
    log_level: LogLevel = typer.Option(LogLevel.WARNING, "--log-level", help="uvicorn and infer log level."),
    *,
    knobs: Knobs,
) -> None:
    logging.basicConfig(
        level=log_level.value.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        options = knobs.model_options(progress=RichProgress(_console))
        _console.print(f"infer serve: loading {model}")
        loaded = load_model(model, options)
    except (ContractError, ModelLoadError, ShardError, ConfigError, WeightsError, MemoryBudgetError) as exc:
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

    engine = options.engine
    steps = "async scheduling" if engine.async_scheduling_enabled else "synchronous steps"
    steps = "overlapped prefill" if engine.async_prefill else steps

    def announce(bound_port: int) -> None:
        shown_host = f"[{host}]" if ":" in host else host
        _stdout.print(
            f"infer: serving [bold]{name}[/bold] (max_model_len {loaded.max_model_len}, {steps}) at "
            f"[bold]http://{shown_host}:{bound_port}/v1[/bold]",
            soft_wrap=True,  # one line whatever the terminal's width: scripts read the URL from it
        )

    try:
        asyncio.run(serve(app, host, port, announce, log_level=log_level.value))
    except ServerStartError as exc:
        _console.print(f"[red]infer serve:[/red] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
