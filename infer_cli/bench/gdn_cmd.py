"""`infer bench gdn`: one GDN layer's prefill and decode per backend against its floor (GPU)."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from infer_cli.bench.options import parse_counts


def bench_gdn_command(
    backend: list[str] | None = typer.Option(
        None,
        "--backend",
        help="Only these GDN backends (repeatable): torch, fla, flashinfer. Default: every one available.",
    ),
    geometry: str = typer.Option("4b,9b", "--geometry", help="Comma-separated presets: 4b, 9b."),
    prefill_tokens: str = typer.Option("1024,8192,32768", "--prefill-tokens", help="Prefill token counts."),
    decode_batch: str = typer.Option("1,64", "--decode-batch", help="Decode batch sizes."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table."),
) -> None:
    console = Console(stderr=as_json)
    import torch

    if not torch.cuda.is_available():
        console.print("[red]infer bench gdn needs a CUDA GPU; none is available on this machine.[/red]")
        raise typer.Exit(2)

    from infer_cli.bench.gdn_timing import GEOMETRIES, run_gdn_bench

    geometries = [g.strip() for g in geometry.split(",") if g.strip()]
    unknown = sorted(set(geometries) - set(GEOMETRIES))
    if unknown:
        raise typer.BadParameter(
            f"unknown geometry {unknown}; known: {sorted(GEOMETRIES)}", param_hint="--geometry"
        )
    try:
        result = run_gdn_bench(
            backend,
            geometries,
            tuple(parse_counts(prefill_tokens, "--prefill-tokens")),
            tuple(parse_counts(decode_batch, "--decode-batch")),
            on_step=lambda what: console.print(f"[dim]{what}[/dim]"),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--backend") from exc
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    for name, why in result.refused.items():
        console.print(f"[yellow]not measured: {name}: {why}[/yellow]")
    for name, what in result.backends.items():
        console.print(f"{name}: {what}")
    table = Table(
        title=(
            f"GDN delta rule, one layer · {result.device} · {result.dtype} · copy {result.copy_gb_per_s:,.0f} GB/s "
            f"(read+write) · matmul {result.matmul_tflops:,.0f} TFLOP/s"
        )
    )
    for column in (
        "backend",
        "geometry",
        "phase",
        "shape",
        "median ms",
        "tokens/s",
        "floor ms",
        "% of floor",
    ):
        table.add_column(
            column, justify="left" if column in ("backend", "geometry", "phase", "shape") else "right"
        )
    for t in result.timings:
        table.add_row(
            t.backend,
            t.geometry,
            t.phase,
            t.shape,
            f"{t.median_ms:,.3f}",
            f"{t.tokens_per_s:,.0f}",
            f"{t.floor_ms:,.3f} ({t.floor_kind})",
            f"{100 * t.floor_fraction:.1f}",
        )
    console.print(table)
