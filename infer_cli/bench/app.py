"""`infer bench`: the benchmark group. `--buckets` on the group itself; sub-commands per benchmark."""

from __future__ import annotations

from pathlib import Path

import typer

from infer_cli.bench.buckets_cmd import run_bucket_bench
from infer_cli.bench.gdn_cmd import bench_gdn_command
from infer_cli.bench.gemm_cmd import bench_gemm_command
from infer_cli.bench.kernels_cmd import bench_kernels_command
from infer_cli.bench.latency_cmd import bench_latency_command
from infer_cli.bench.serve_cmd import bench_serve_command
from infer_cli.bench.table_cmd import bench_table_command
from infer_cli.engine_options import Knobs, knob_options

bench_app = typer.Typer(
    help="Benchmarks: CUDA-graph bucket sweeps (--buckets), serving load, kernels, latency.",
    invoke_without_command=True,
    no_args_is_help=False,
)


@bench_app.callback()
@knob_options(
    "gpu_memory_utilization", "attention_backend", "tensor_parallel_size", help_prefix="--buckets: "
)
def bench_callback(
    ctx: typer.Context,
    buckets: str | None = typer.Option(
        None, "--buckets", help="CUDA-graph memory sweep over decode batch buckets (e.g. 1,2,4,8 or 'all')."
    ),
    model: Path | None = typer.Option(None, "--model", help="--buckets: checkpoint directory."),
    # Not the engine knob: a list of policies, each swept in turn.
    numeric_policy: str = typer.Option(
        "tuned",
        "--numeric-policy",
        help="--buckets: comma-separated policies (tuned,pin,per-token,invariant).",
    ),
    save_result: Path | None = typer.Option(
        None, "--save-result", help="--buckets: write the results as JSON."
    ),
    plot: bool = typer.Option(
        False, "--plot", help="--buckets: PNG of memory against bucket (next to --save-result, .png)."
    ),
    *,
    knobs: Knobs,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    if buckets is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    run_bucket_bench(
        buckets,
        model,
        numeric_policy,
        knobs["gpu_memory_utilization"],
        save_result,
        plot,
        knobs["attention_backend"],
        tensor_parallel_size=knobs["tensor_parallel_size"],
    )


bench_app.command("serve", help="Load generator against any OpenAI-compatible server.")(bench_serve_command)
bench_app.command("kernels", help="Time the attention-prep kernels against the copy bandwidth (GPU).")(
    bench_kernels_command
)
bench_app.command("latency", help="Decode step time and prefill throughput against the roofline (GPU).")(
    bench_latency_command
)
bench_app.command("gemm", help="Time the skinny Triton GEMM against cuBLAS on the decode projections (GPU).")(
    bench_gemm_command
)
bench_app.command("gdn", help="Time one GDN layer's prefill and decode per backend against its floor (GPU).")(
    bench_gdn_command
)
bench_app.command("table", help="Issue #18's target table from saved latency results, vLLM's beside them.")(
    bench_table_command
)
