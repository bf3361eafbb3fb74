"""The `infer` command: assembles the command groups; each lives in its own module."""

from __future__ import annotations

import typer

from infer_cli.bench.app import bench_app
from infer_cli.convert_cmd import convert_app
from infer_cli.gates_cmd import gates_command
from infer_cli.serve_cmd import serve_command
from infer_cli.synth_cmd import synth_command

app = typer.Typer(
    name="infer",
    help="LLM inference toolkit: OpenAI-compatible serving, correctness gates, benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("serve", help="Serve a model over an OpenAI-compatible HTTP API.")(serve_command)
app.command("gates", help="Run a checked-in manifest of checkpoint-backed correctness gates.")(gates_command)
app.command("run-gates", help="Alias of `gates`.", hidden=False)(gates_command)
app.command("synth", help="Write a synthetic Hugging Face checkpoint (random weights, real tensor names).")(
    synth_command
)
app.add_typer(bench_app, name="bench")
app.add_typer(convert_app, name="convert")


if __name__ == "__main__":
    app()
