"""`infer bench gemm`: the skinny Triton GEMM and the fused decode GEMV against cuBLAS on the decode
projections (GPU).

Options are parsed here, before torch looks for a device; the measurement is
`infer_cli.bench.gemm_timing` (what is timed and how: its docstring, docs/kernels.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from engine.progress import task
from infer_cli.bench.options import parse_counts
from infer_cli.progress import RichProgress

if TYPE_CHECKING:  # the module imports torch and Triton; the command imports it only once it runs
    from infer_cli.bench.gemm_timing import GemmBenchResult

# The skinny kernel's row limit (kernels.triton.skinny_gemm.MAX_ROWS; a test holds them equal),
# written here so that parsing the CLI does not import torch and Triton.
MAX_ROWS = 64
MODEL_CHOICES = ("qwen3-4b", "gemma4-12b", "qwen35-4b")
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64)


def parse_models(raw: str) -> tuple[str, ...]:
    """``qwen3-4b``, ``gemma4-12b``, ``qwen35-4b`` or ``all`` (every one, in that order)."""
    name = raw.strip()
    if name == "all":
        return MODEL_CHOICES
    if name not in MODEL_CHOICES:
        raise typer.BadParameter(
            f"{raw!r} is not a benchmarked model; choose {', '.join(MODEL_CHOICES)} or all",
            param_hint="--model",
        )
    return (name,)


def parse_gemm_rows(raw: str | None) -> tuple[int, ...]:
    """A comma-separated list of row counts, each 1..64 (the skinny kernel's range), ascending."""
    if raw is None:
        return DEFAULT_ROWS
    return tuple(sorted(set(parse_counts(raw, "--rows", maximum=MAX_ROWS))))


def bench_gemm_command(
    model: str = typer.Option("all", "--model", help="qwen3-4b, gemma4-12b, qwen35-4b or all."),
    rows: str | None = typer.Option(
        None, "--rows", help="Row counts M, comma-separated (default 1,2,4,8,16,32,64)."
    ),
    save_result: Path | None = typer.Option(None, "--save-result", help="Write the results as JSON to FILE."),
    save_dispatch: Path | None = typer.Option(
        None,
        "--save-dispatch",
        help="Write the per-shape choice table (kernels.gemm.skinny_dispatch) to FILE.",
    ),
    chain: bool = typer.Option(True, "--chain/--no-chain", help="Also time each model's whole decode chain."),
) -> None:
    console = Console()
    models = parse_models(model)
    row_counts = parse_gemm_rows(rows)

    import torch

    if not torch.cuda.is_available():
        console.print("[red]infer bench gemm needs a CUDA GPU; none is available on this machine.[/red]")
        raise typer.Exit(2)

    from infer_cli.bench.gemm_timing import gemm_bench_plan, run_gemm_bench

    plan = gemm_bench_plan(models, row_counts, chains=chain)

    def save(result: GemmBenchResult) -> None:
        # After every shape and chain: a run stopped early still leaves what it measured.
        if save_result is not None:
            save_result.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        if save_dispatch is not None:
            result.dispatch_table().save(save_dispatch)

    progress = RichProgress(console)
    with task(progress, "copy bandwidth", plan.steps):
        result = run_gemm_bench(plan, on_step=progress.advance, on_partial=save)
    save(result)
    print_result(console, result)
    for path in (save_result, save_dispatch):
        if path is not None:
            console.print(f"saved {path}")


def _us(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def print_result(console: Console, result: GemmBenchResult) -> None:
    shapes = Table(
        title=f"skinny GEMM, fused GEMV and fused MMA vs cuBLAS · {result.device} · {result.dtype} · "
        f"copy {result.copy_gb_per_s:,.0f} GB/s (read+write) · PDL {'on' if result.pdl else 'off'}"
    )
    columns = (
        "model",
        "shape",
        "N × K",
        "M",
        "cuBLAS µs",
        "ours µs",
        "floor µs",
        "cuBLAS %",
        "ours %",
        "wins",
        "fused µs",
        "fused %",
        "mma µs",
        "mma %",
        "mma settings",
    )
    for column in columns:
        shapes.add_column(
            column, justify="left" if column in ("model", "shape", "wins", "mma settings") else "right"
        )
    for t in result.timings:
        shapes.add_row(
            t.model,
            t.name,
            f"{t.n} × {t.k}",
            str(t.rows),
            f"{t.cublas_us:,.1f}",
            f"{t.ours_us:,.1f}",
            f"{t.floor_us:,.1f}",
            f"{t.cublas_floor_pct:.1f}",
            f"{t.ours_floor_pct:.1f}",
            t.winner.value,
            _us(t.fused_us, 1),
            _us(t.fused_floor_pct, 1),
            _us(t.mma_us, 1),
            _us(t.mma_floor_pct, 1),
            t.mma_settings or "—",
        )
    console.print(shapes)

    settings = Table(title="skinny settings kept per shape (one for every M)")
    for column in ("N × K", "settings"):
        settings.add_column(column)
    for (n, k), chosen in result.chosen:
        settings.add_row(f"{n} × {k}", chosen.label)
    console.print(settings)

    if result.chains:
        chains = Table(title="whole decode chain (every projection of every layer once, then the LM head)")
        figures = (
            "cuBLAS µs",
            "ours µs",
            "best µs",
            "fused layers µs",
            "cuBLAS %",
            "ours %",
            "best %",
            "fused layers %",
        )
        for column in ("model", "M", "GEMMs", "GB", "floor µs", *figures):
            chains.add_column(column, justify="left" if column == "model" else "right")
        for c in result.chains:
            times = (c.cublas_us, c.ours_us, c.best_us, c.fused_us)
            chains.add_row(
                c.model,
                str(c.rows),
                str(c.gemms),
                f"{c.bytes_moved / 1e9:.2f}",
                _us(c.floor_us),
                *(_us(us) for us in times),
                *(_us(c.floor_pct(us), 1) for us in times),
            )
        console.print(chains)
    for failure in result.failures:
        console.print(f"[yellow]failed: {failure.what}: {failure.error}[/yellow]")
