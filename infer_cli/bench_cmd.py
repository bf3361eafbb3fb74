"""`infer bench`: the benchmark group. `--buckets` on the group itself; sub-commands per benchmark."""

from __future__ import annotations

import typer

from infer_cli.bench_kernels import bench_kernels_command
from infer_cli.bench_latency import bench_latency_command
from infer_cli.bench_serve import bench_serve_command

bench_app = typer.Typer(
    help="Benchmarks: CUDA-graph bucket sweeps (--buckets), serving load, kernels, latency.",
    invoke_without_command=True,
    no_args_is_help=False,
)


@bench_app.callback()
def bench_callback(
    ctx: typer.Context,
    buckets: str | None = typer.Option(
        None, "--buckets", help="CUDA-graph memory sweep over decode batch buckets (e.g. 1,2,4,8 or 'all')."
    ),
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    if buckets is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    typer.secho(
        "infer bench --buckets is not built yet (see the numeric-policies issue).", fg="red", err=True
    )
    raise typer.Exit(2)


bench_app.command("serve", help="Load generator against any OpenAI-compatible server.")(bench_serve_command)
bench_app.command("kernels", help="Time the attention-prep kernels against the copy bandwidth (GPU).")(
    bench_kernels_command
)
bench_app.command("latency", help="Decode step time and prefill throughput against the roofline (GPU).")(
    bench_latency_command
)
