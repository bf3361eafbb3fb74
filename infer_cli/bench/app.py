"""`infer bench`: the benchmark group. `--buckets` on the group itself; sub-commands per benchmark."""

from __future__ import annotations

from pathlib import Path

import typer

from infer_cli.bench.buckets_cmd import run_bucket_bench
from infer_cli.bench.kernels_cmd import bench_kernels_command
from infer_cli.bench.latency_cmd import bench_latency_command
from infer_cli.bench.serve_cmd import bench_serve_command

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
    model: Path | None = typer.Option(None, "--model", help="--buckets: checkpoint directory."),
    numeric_policy: str = typer.Option(
        "tuned",
        "--numeric-policy",
        help="--buckets: comma-separated policies (tuned,pin,per-token,invariant).",
    ),
    gpu_memory_utilization: float = typer.Option(
        0.9, "--gpu-memory-utilization", help="--buckets: budget fraction."
    ),
    attention_backend: str | None = typer.Option(
        None, "--attention-backend", help="--buckets: torch or flashinfer."
    ),
    save_result: Path | None = typer.Option(
        None, "--save-result", help="--buckets: write the results as JSON."
    ),
    plot: bool = typer.Option(
        False, "--plot", help="--buckets: PNG of memory against bucket (next to --save-result, .png)."
    ),
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    if buckets is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    run_bucket_bench(
        buckets, model, numeric_policy, gpu_memory_utilization, save_result, plot, attention_backend
    )


bench_app.command("serve", help="Load generator against any OpenAI-compatible server.")(bench_serve_command)
bench_app.command("kernels", help="Time the attention-prep kernels against the copy bandwidth (GPU).")(
    bench_kernels_command
)
bench_app.command("latency", help="Decode step time and prefill throughput against the roofline (GPU).")(
    bench_latency_command
)
