"""`infer bench table`: issue #18's target table from saved latency results, vLLM beside them."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from infer_cli.bench.target_table import (
    LatencyRun,
    ResultFileError,
    breakdown_rows,
    load_latency_run,
    load_vllm_decode,
    markdown,
    target_rows,
)


def bench_table_command(
    results: list[str] = typer.Argument(
        ...,
        help="`infer bench latency --save-result` files, each FILE or LABEL=FILE (label: the file's stem).",
    ),
    vllm: Path | None = typer.Option(
        None, "--vllm", help="vLLM's decode per step on the same checkpoint (vllm_decode.py --save)."
    ),
    policy: str = typer.Option("tuned", "--policy", help="The numeric policy whose rows are read."),
    as_markdown: bool = typer.Option(
        False, "--markdown", help="Print Markdown tables (for docs/benchmarks/)."
    ),
) -> None:
    try:
        runs = [_load(spec, policy) for spec in results]
        vllm_decode = None if vllm is None else load_vllm_decode(vllm)
    except ResultFileError as exc:
        raise typer.BadParameter(str(exc)) from None
    tables = [("targets", target_rows(runs, vllm_decode)), ("where each step went", breakdown_rows(runs))]
    if as_markdown:
        typer.echo("\n\n".join(markdown(header, rows) for _, (header, rows) in tables))
        return
    console = Console()
    devices = sorted({run.device for run in runs})
    for title, (header, rows) in tables:
        table = Table(title=f"{title} · {', '.join(devices)}")
        for column in header:
            table.add_column(column, justify="left" if column in ("", "run", "step") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for run in runs:
        console.print(f"{run.label}: {', '.join(run.flags) or 'defaults'}")


def _load(spec: str, policy: str) -> LatencyRun:
    label, sep, path = spec.partition("=")
    if not sep:
        return load_latency_run(Path(spec), policy=policy)
    return load_latency_run(Path(path), label, policy)
