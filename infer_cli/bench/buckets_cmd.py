"""`infer bench --buckets`: the CUDA-graph memory sweep's options, table, JSON and plot.

The sweep measures decode graphs; under tensor parallelism no graph is captured (a graph would hold
the ranks' collectives, which is not built: docs/tensor-parallel.md), so `--tensor-parallel-size`
above 1 is refused by name, and the saved result records the size it ran at.

The measuring lives in infer_cli.bench.bucket_sweep; this module parses the options, prints, saves and plots.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from engine.cuda_graphs import MAX_GRAPH_BUCKET, decode_buckets
from engine.memory_budget import MemoryBudgetError
from infer_cli.bench.options import parse_counts
from infer_cli.progress import RichProgress
from kernels.gemm.names import UnknownPolicyError, parse_policies

MIB = 1 << 20


def parse_buckets(text: str) -> tuple[int, ...]:
    """`all` (the engine's buckets up to 256) or comma-separated sizes in 1..256, sorted, each once."""
    if text.strip() == "all":
        return decode_buckets(MAX_GRAPH_BUCKET)
    return tuple(sorted(set(parse_counts(text, "--buckets", maximum=MAX_GRAPH_BUCKET))))


def bucket_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"decode graphs · {result.get('model', '')} · {result.get('device', '')}")
    columns = (
        "policy",
        "bucket",
        "free Δ MiB",
        "pool Δ MiB",
        "1st capture outside pool MiB",
        "nodes",
        "replay ms",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for sweep in result["policies"]:
        for m in sweep["buckets"]:
            first = m.get("first_outside_pool_bytes")  # absent from reports before 2026-12-02 evening
            table.add_row(
                sweep["policy"],
                str(m["bucket"]),
                f"{m['device_bytes'] / MIB:,.1f}",
                f"{m['pool_bytes'] / MIB:,.1f}",
                "—" if first is None else f"{first / MIB:,.1f}",
                "—" if m["nodes"] is None else str(m["nodes"]),
                f"{m['replay_ms']:.3f}",
            )
    return table


def budget_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"KV budget check (utilisation {result.get('gpu_memory_utilization', '?')})")
    for column in (
        "policy",
        "reserved MiB",
        "measured MiB",
        "diff %",
        "graphs may take MiB",
        "largest bucket that fits",
    ):
        table.add_column(column, justify="right")
    for sweep in result["policies"]:
        largest = sweep["largest_bucket_that_fits"]
        table.add_row(
            sweep["policy"],
            f"{sweep['reserved_bytes'] / MIB:,.1f}",
            f"{sweep['measured_bytes'] / MIB:,.1f}",
            f"{sweep['reserved_vs_measured_pct']:+.1f}",
            f"{sweep['graphs_available_bytes'] / MIB:,.0f}",
            "none" if largest is None else str(largest),
        )
    return table


def plot_sweeps(result: dict[str, Any], path: Path) -> None:
    """PNG, one line per policy: left, cumulative graph memory (MiB) against bucket, as the engine
    reserves it; right, where the report has it, what each bucket's first capture took outside
    torch's pool (its nodes' memory), the figure that grows with the bucket when GEMMs go row by row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = [(s["policy"], sorted(s["buckets"], key=lambda m: m["bucket"])) for s in result["policies"]]
    with_first = all("first_outside_pool_bytes" in m for _, rows in sweeps for m in rows)
    fig, axes = plt.subplots(1, 2 if with_first else 1, figsize=(14 if with_first else 8, 5), squeeze=False)
    cumulative = axes[0][0]
    for policy, rows in sweeps:
        xs = [m["bucket"] for m in rows]
        totals, total = [], 0
        for m in rows:
            total += m["device_bytes"]
            totals.append(total / MIB)
        cumulative.plot(xs, totals, marker="o", markersize=3, label=policy)
        if with_first:
            first = [m["first_outside_pool_bytes"] / MIB for m in rows]
            axes[0][1].plot(xs, first, marker="o", markersize=3, label=policy)
    cumulative.set_ylabel("graph memory, cumulative (MiB)")
    cumulative.set_title("what the KV budget reserves (second capture)")
    if with_first:
        axes[0][1].set_ylabel("first capture, outside the pool (MiB per bucket)")
        axes[0][1].set_title("each graph's own memory (first capture)")
    for ax in axes[0]:
        ax.set_xlabel("decode bucket (rows)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"CUDA-graph memory per bucket · {Path(str(result.get('model', ''))).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bucket_bench(
    buckets_text: str,
    model: Path | None,
    numeric_policy: str,
    gpu_memory_utilization: float,
    save_result: Path | None,
    plot: bool,
    attention_backend: str | None,
    console: Console | None = None,
    tensor_parallel_size: int = 1,
) -> None:
    console = console or Console()
    if tensor_parallel_size < 1:
        raise typer.BadParameter(
            f"{tensor_parallel_size}: must be at least 1", param_hint="--tensor-parallel-size"
        )
    if tensor_parallel_size > 1:
        raise typer.BadParameter(
            f"{tensor_parallel_size}: the bucket sweep measures one device's decode graphs; a sweep "
            "over sharded ranks is not built (docs/tensor-parallel.md)",
            param_hint="--tensor-parallel-size",
        )
    buckets = parse_buckets(buckets_text)
    try:
        policies = parse_policies(numeric_policy)
    except UnknownPolicyError as exc:
        raise typer.BadParameter(str(exc), param_hint="--numeric-policy") from None
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise typer.BadParameter(
            f"{gpu_memory_utilization}: must be in (0, 1]", param_hint="--gpu-memory-utilization"
        )
    if model is None:
        raise typer.BadParameter("a checkpoint directory is required", param_hint="--model")
    import torch

    if not torch.cuda.is_available():
        console.print(
            "[red]infer bench --buckets captures CUDA graphs and needs a CUDA GPU; none is available on this machine.[/red]"
        )
        raise typer.Exit(2)
    from infer_cli.bench.bucket_sweep import sweep_json, sweep_policy

    # per-token's first capture leaves memory resident outside torch that later captures in this
    # process reuse (infer_cli.bench.bucket_sweep); swept last, it hides no other policy's first-capture cost.
    policies = tuple(sorted(policies, key=lambda p: p.value == "per-token"))
    sweeps = []
    # A policy whose graphs do not fit is refused by name (engine.graph_budget) and the others go on.
    refused: dict[str, str] = {}
    progress = RichProgress(console)
    for policy in policies:
        console.print(f"{policy.value}: loading, then capturing {len(buckets)} buckets twice")
        try:
            sweeps.append(
                sweep_policy(
                    model, policy.value, buckets, gpu_memory_utilization, attention_backend, progress
                )
            )
        except MemoryBudgetError as exc:
            refused[policy.value] = str(exc)
            console.print(f"[red]{policy.value}: refused: {exc}[/red]")
        # A refused policy's model is unreachable only once its error is gone: free it here,
        # before the next policy loads.
        gc.collect()
        torch.cuda.empty_cache()
    if not sweeps:
        raise typer.Exit(2)
    result = sweep_json(
        sweeps,
        {
            "model": str(model),
            "device": torch.cuda.get_device_name(),
            "gpu_memory_utilization": gpu_memory_utilization,
            "bucket_list": list(buckets),
            "refused": refused,
            "tensor_parallel_size": tensor_parallel_size,
        },
    )
    _report(result, console, save_result, plot)


def _report(result: dict[str, Any], console: Console, save_result: Path | None, plot: bool) -> None:
    console.print(bucket_table(result))
    console.print(budget_table(result))
    if save_result is not None:
        save_result.parent.mkdir(parents=True, exist_ok=True)
        save_result.write_text(json.dumps(result, indent=2))
        console.print(f"saved {save_result}")
    if plot:
        path = save_result.with_suffix(".png") if save_result is not None else Path("bench-buckets.png")
        plot_sweeps(result, path)
        console.print(f"plotted {path}")
