"""`infer bench latency`: decode step time per batch size and prefill throughput, against floors."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"{text!r}: expected comma-separated integers", param_hint=option) from exc
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"{text!r}: expected positive integers", param_hint=option)
    return values


def bench_latency_command(
    model: Path = typer.Option(
        ..., "--model", help="Checkpoint directory (e.g. from `infer synth ... --device cuda`)."
    ),
    batch_sizes: str = typer.Option("1,8,32,64,128,256", "--batch-sizes", help="Decode batch sizes."),
    context: int = typer.Option(512, "--context", help="Tokens of KV each decode row attends to."),
    prefill_lens: str = typer.Option(
        "1024,8192", "--prefill-lens", help="Prompt lengths prefilled in one step."
    ),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Decode without CUDA graphs."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
    save_result: Path | None = typer.Option(None, "--save-result", help="Write the results as JSON to FILE."),
) -> None:
    console = Console()
    import torch

    if not torch.cuda.is_available():
        console.print("[red]infer bench latency needs a CUDA GPU; none is available on this machine.[/red]")
        raise typer.Exit(2)
    from engine.config import EngineConfig
    from engine.latency_bench import bench_decode, bench_prefill, measure_ceilings, results_json
    from engine.model_runner import PagedModelRunner
    from engine.scheduler import BatchScheduler
    from models.registry import ModelOptions, load_model

    batches = _ints(batch_sizes, "--batch-sizes")
    prompts = _ints(prefill_lens, "--prefill-lens")
    engine = EngineConfig(
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(*prompts, max(batches)),
        enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=False,
    )
    loaded = load_model(str(model), ModelOptions(engine=engine, device="cuda"))
    scheduler = loaded.scheduler
    if not isinstance(scheduler, BatchScheduler) or not isinstance(scheduler.runner, PagedModelRunner):
        raise typer.BadParameter(f"{model}: not a paged model line", param_hint="--model")
    paged = scheduler.runner.model
    facts = paged.roofline()
    ceilings = measure_ceilings(torch.device("cuda"))
    decode, prefill = [], []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(batches) + len(prompts))
        for batch in batches:
            progress.update(task, description=f"decode batch {batch}")
            decode.append(bench_decode(scheduler, facts, ceilings, batch, context))
            progress.advance(task)
        for tokens in prompts:
            progress.update(task, description=f"prefill {tokens} tokens")
            prefill.append(bench_prefill(scheduler, facts, ceilings, tokens))
            progress.advance(task)

    title = (
        f"{model.name} · {torch.cuda.get_device_name()} · copy {ceilings.copy_gb_per_s:,.0f} GB/s · "
        f"bf16 matmul {ceilings.matmul_tflops:,.0f} TFLOP/s"
    )
    table = Table(title=f"decode ({context}-token contexts) · {title}")
    for column in ("batch", "step ms", "graph replay ms", "floor ms", "% of floor", "tok/s"):
        table.add_column(column, justify="right")
    for d in decode:
        replay = "—" if d.replay_ms is None else f"{d.replay_ms:.3f}"
        table.add_row(
            str(d.batch),
            f"{d.step_ms:.3f}",
            replay,
            f"{d.floor_ms:.3f}",
            f"{d.step_pct_of_floor:.1f}",
            f"{d.tokens_per_s:,.0f}",
        )
    console.print(table)
    table = Table(title="prefill (one request, one step)")
    for column in ("tokens", "ms", "floor ms", "% of floor", "tok/s"):
        table.add_column(column, justify="right")
    for p in prefill:
        table.add_row(
            str(p.tokens),
            f"{p.ms:.2f}",
            f"{p.floor_ms:.2f}",
            f"{p.pct_of_floor:.1f}",
            f"{p.tokens_per_s:,.0f}",
        )
    console.print(table)
    if save_result is not None:
        payload = results_json(decode, prefill, ceilings, facts) | {
            "model": str(model),
            "device": torch.cuda.get_device_name(),
            "context": context,
            "graphs": not enforce_eager,
        }
        save_result.write_text(json.dumps(payload, indent=2))
        console.print(f"saved {save_result}")
