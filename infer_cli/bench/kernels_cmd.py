"""`infer bench kernels`: the attention-prep kernel's achieved bandwidth against the copy bandwidth."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from engine.progress import task
from infer_cli.bench.options import parse_counts
from infer_cli.progress import RichProgress


def _parse_rows(raw: str | None, option: str) -> tuple[int, ...] | None:
    return None if raw is None else tuple(parse_counts(raw, option))


def bench_kernels_command(
    save_result: Path | None = typer.Option(None, "--save-result", help="Write the results as JSON to FILE."),
    variant: list[str] | None = typer.Option(
        None, "--variant", help="Only these variants (repeatable), e.g. qwen3-4b, gemma4-12b-global."
    ),
    decode_rows: str | None = typer.Option(
        None, "--decode-rows", help="Decode row counts (default 1,8,64,256)."
    ),
    prefill_rows: str | None = typer.Option(
        None, "--prefill-rows", help="Prefill row counts (default 2048,8192,16384)."
    ),
) -> None:
    console = Console()
    decode = _parse_rows(decode_rows, "--decode-rows")
    prefill = _parse_rows(prefill_rows, "--prefill-rows")

    import torch

    if not torch.cuda.is_available():
        console.print("[red]infer bench kernels needs a CUDA GPU; none is available on this machine.[/red]")
        raise typer.Exit(2)

    from infer_cli.bench.prep_timing import (
        BENCH_VARIANTS,
        DECODE_ROWS,
        PREFILL_ROWS,
        bench_plan,
        run_kernel_bench,
    )

    known = {v.label: v for v in BENCH_VARIANTS}
    unknown = sorted(set(variant or ()) - set(known))
    if unknown:
        raise typer.BadParameter(
            f"unknown variant(s) {unknown}; known: {sorted(known)}", param_hint="--variant"
        )
    chosen = tuple(known[name] for name in variant) if variant else BENCH_VARIANTS
    plan = bench_plan(chosen, decode or DECODE_ROWS, prefill or PREFILL_ROWS)

    progress = RichProgress(console)
    with task(progress, "copy bandwidth", len(plan) + 1):
        result = run_kernel_bench(plan, on_step=progress.advance)

    table = Table(
        title=f"attention prep · {result.device} · {result.dtype} · copy {result.copy_gb_per_s:,.0f} GB/s (read+write)"
    )
    for column in ("variant", "phase", "rows", "median µs", "MB moved", "GB/s", "% of copy"):
        table.add_column(column, justify="left" if column in ("variant", "phase") else "right")
    for timing in result.timings:
        table.add_row(
            timing.variant,
            timing.phase,
            f"{timing.rows:,}",
            f"{timing.median_us:,.1f}",
            f"{timing.bytes_moved / 1e6:,.2f}",
            f"{timing.gb_per_s:,.0f}",
            f"{100 * timing.copy_fraction:.1f}",
        )
    console.print(table)
    if save_result is not None:
        save_result.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        console.print(f"saved {save_result}")
