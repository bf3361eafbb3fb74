"""`infer bench latency`: decode step time per batch size and prefill throughput, against floors,
under one or more numeric policies (one model load per policy, one row group per policy). A Qwen3.5
checkpoint runs on the `--gdn-backend` given; the report says what that backend chose per phase.
At `--tensor-parallel-size N` > 1 the model is split over N GPUs (rank 0 on the first): the split is
checked before anything is measured or loaded, every rank captures its decode graphs (collectives
inside), the floors are rank 0's (its shard's bytes and flops on one device), and the saved result records N."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from infer_cli.bench.options import parse_counts
from infer_cli.bench.target_table import run_flags
from infer_cli.engine_options import Knobs, knob_options
from infer_cli.progress import RichProgress
from kernels.gemm.names import UnknownPolicyError, parse_policies
from models.registry import ModelOptions

if TYPE_CHECKING:
    from engine.forward_batch import RooflineFacts
    from infer_cli.bench.latency import Ceilings, PolicyRun
    from infer_cli.bench.step_profile import StepBreakdown


@knob_options(
    "enforce_eager",
    "prefill_graphs",
    "gpu_memory_utilization",
    "async_scheduling",
    "gdn_backend",
    "attention_backend",
    "decode_fusion",
    "sampling_backend",
    "tensor_parallel_size",
    "collective_timeout_s",
)
def bench_latency_command(
    model: Path = typer.Option(
        ..., "--model", help="Checkpoint directory (e.g. from `infer synth ... --device cuda`)."
    ),
    batch_sizes: str = typer.Option("1,8,32,64,128,256", "--batch-sizes", help="Decode batch sizes."),
    context: int = typer.Option(512, "--context", help="Tokens of KV each decode row attends to."),
    temperature: float = typer.Option(
        0.0,
        "--temperature",
        help="Decode rows sample at this temperature (0: greedy); vLLM's `bench latency` samples at 1.0.",
    ),
    prefill_lens: str = typer.Option(
        "1024,8192", "--prefill-lens", help="Prompt lengths prefilled in one step."
    ),
    # Not the engine knob: a list of policies, one model load each.
    numeric_policy: str = typer.Option(
        "tuned",
        "--numeric-policy",
        help="Comma-separated numeric policies (tuned,pin,per-token,invariant), each benchmarked in turn.",
    ),
    save_result: Path | None = typer.Option(None, "--save-result", help="Write the results as JSON to FILE."),
    breakdown: bool = typer.Option(
        False,
        "--breakdown",
        help="Also profile a few steps of each measurement: device time per kernel category, and the "
        "host gap (the step's time the device spent idle).",
    ),
    *,
    knobs: Knobs,
) -> None:
    console = Console()
    try:
        policies = [p.value for p in parse_policies(numeric_policy)]
    except UnknownPolicyError as exc:
        raise typer.BadParameter(str(exc), param_hint="--numeric-policy") from exc
    batches = parse_counts(batch_sizes, "--batch-sizes")
    prompts = parse_counts(prefill_lens, "--prefill-lens")
    from kernels.gdn import GDN_BACKENDS

    if knobs["gdn_backend"] not in GDN_BACKENDS:
        raise typer.BadParameter(
            f"{knobs['gdn_backend']!r}: choose from {', '.join(GDN_BACKENDS)}", param_hint="--gdn-backend"
        )
    import torch

    if not torch.cuda.is_available():
        console.print("[red]infer bench latency needs a CUDA GPU; none is available on this machine.[/red]")
        raise typer.Exit(2)
    _check_split(model, knobs)
    from infer_cli.bench.latency import measure_ceilings, results_json

    ceilings = measure_ceilings(torch.device("cuda"))
    runs: list[PolicyRun] = []
    facts: RooflineFacts | None = None
    gdn: str | None = None
    for policy in policies:
        engine = knobs.engine_config(
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(*prompts, max(batches)),
            enable_prefix_caching=False,
            numeric_policy=policy,
        )
        options = knobs.model_options(engine=engine, device="cuda", progress=RichProgress(console))
        run, facts, gdn = _bench_policy(
            model, options, ceilings, batches, prompts, context, temperature, breakdown, console
        )
        runs.append(run)
        # One model on the device at a time: the next policy's load measures its own budget.
        gc.collect()
        torch.cuda.empty_cache()

    settings = {
        "graphs": not knobs["enforce_eager"],
        "prefill_graphs": knobs["prefill_graphs"],
        "async_scheduling": knobs.engine_config().async_scheduling_enabled,
        "attention_backend": knobs["attention_backend"],
        "decode_fusion": knobs["decode_fusion"],
        "temperature": temperature,
        "sampling_backend": knobs["sampling_backend"],
        "tensor_parallel_size": knobs["tensor_parallel_size"],
    }
    title = (
        f"{model.name} · {torch.cuda.get_device_name()} · copy {ceilings.copy_gb_per_s:,.0f} GB/s · "
        f"stream {ceilings.stream_gb_per_s:,.0f} GB/s · bf16 matmul {ceilings.matmul_tflops:,.0f} TFLOP/s"
        + "".join(f" · {flag}" for flag in run_flags(settings))
    )
    if gdn is not None:
        title += f" · GDN {gdn}"
    _print_tables(console, runs, context, title)
    if breakdown:
        console.print(_breakdown_table(runs))
        console.print(_host_calls_table(runs))
    if save_result is not None and facts is not None:
        payload = (
            results_json(runs, ceilings, facts)
            | {
                "model": str(model),
                "device": torch.cuda.get_device_name(),
                "context": context,
                "gdn_backend": None if gdn is None else {"asked": knobs["gdn_backend"], "ran": gdn},
            }
            | settings
        )
        save_result.write_text(json.dumps(payload, indent=2))
        console.print(f"saved {save_result}")


def _check_split(model: Path, knobs: Knobs) -> None:
    """Refuse a tensor-parallel size the checkpoint or this machine cannot take, by name, from the
    config alone: before the ceilings are measured or any policy's model loads."""
    from engine.contract import ContractError
    from engine.parallel.sharding import ShardError
    from models.registry import ModelLoadError, check_tensor_parallel

    try:
        check_tensor_parallel(model, knobs.model_options(device="cuda"))
    except (ContractError, ModelLoadError, ShardError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--tensor-parallel-size") from None


def _bench_policy(
    model: Path,
    options: ModelOptions,
    ceilings: Ceilings,
    batches: list[int],
    prompts: list[int],
    context: int,
    temperature: float,
    breakdown: bool,
    console: Console,
) -> tuple[PolicyRun, RooflineFacts, str | None]:
    """Load `model` with `options` (its engine's numeric policy), run every decode and prefill
    measurement, and return them with the model's roofline facts and, for a model with GDN layers,
    what its GDN backend runs; the model is released when this returns."""
    import torch

    from engine.model_runner import PagedModelRunner
    from engine.parallel.runner import TensorParallelRunner
    from engine.scheduler import BatchScheduler
    from infer_cli.bench.latency import PolicyRun, bench_decode, bench_prefill
    from kernels.gdn import GDNBackend
    from models.registry import load_model

    policy = options.engine.numeric_policy
    loaded = load_model(str(model), options)
    scheduler = loaded.scheduler
    if not isinstance(scheduler, BatchScheduler) or not isinstance(
        scheduler.runner, PagedModelRunner | TensorParallelRunner
    ):
        raise typer.BadParameter(f"{model}: not a paged model line", param_hint="--model")
    # Sharded: rank 0's model, so the floors are one rank's shard on one device.
    paged = scheduler.runner.local if isinstance(scheduler.runner, TensorParallelRunner) else scheduler.runner
    facts = paged.model.roofline()
    backend = getattr(paged.model, "gdn", None)
    gdn = backend.describe() if isinstance(backend, GDNBackend) else None
    decode, prefill = [], []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"{policy}: benchmarking", total=len(batches) + len(prompts))
        for batch in batches:
            progress.update(task, description=f"{policy}: decode batch {batch}")
            decode.append(
                bench_decode(
                    scheduler, facts, ceilings, batch, context, breakdown=breakdown, temperature=temperature
                )
            )
            progress.advance(task)
        for tokens in prompts:
            progress.update(task, description=f"{policy}: prefill {tokens} tokens")
            prefill.append(bench_prefill(scheduler, facts, ceilings, tokens, breakdown=breakdown))
            progress.advance(task)
    if isinstance(scheduler.runner, TensorParallelRunner):
        scheduler.runner.close()  # the workers hold their GPUs until they stop
    del scheduler, loaded, paged
    torch.cuda.synchronize()
    return PolicyRun(policy, tuple(decode), tuple(prefill)), facts, gdn


def _say_allocator(console: Console, runs: list[PolicyRun]) -> None:
    """Name every measurement whose timed steps made the caching allocator go to the device: its
    time includes cudaMalloc/cudaFree, which synchronise, and is not the kernels' alone."""
    for run in runs:
        measured = [(f"decode {d.batch}", d.allocator) for d in run.decode]
        measured += [(f"prefill {p.tokens}", p.allocator) for p in run.prefill]
        for name, counts in measured:
            if counts is not None and not counts.quiet:
                console.print(
                    f"[yellow]{run.policy} {name}: the allocator made {counts.device_allocs} device "
                    f"allocations, {counts.device_frees} frees and {counts.retries} retries during the "
                    "timed steps[/yellow]"
                )


def _print_tables(console: Console, runs: list[PolicyRun], context: int, title: str) -> None:
    table = Table(title=f"decode ({context}-token contexts) · {title}")
    columns = ("policy", "batch", "step ms", "graph replay ms", "floor ms", "% of floor", "% of stream floor")
    for column in (*columns, "tok/s"):
        table.add_column(column, justify="right")
    for run in runs:
        for d in run.decode:
            replay = "—" if d.replay_ms is None else f"{d.replay_ms:.3f}"
            table.add_row(
                run.policy,
                str(d.batch),
                f"{d.step_ms:.3f}",
                replay,
                f"{d.floor_ms:.3f}",
                f"{d.step_pct_of_floor:.1f}",
                f"{d.step_pct_of_stream_floor:.1f}",
                f"{d.tokens_per_s:,.0f}",
            )
        table.add_section()
    console.print(table)
    table = Table(title="prefill (one request, one step)")
    for column in ("policy", "tokens", "ms", "runs' range ms", "floor ms", "% of floor", "tok/s"):
        table.add_column(column, justify="right")
    for run in runs:
        for p in run.prefill:
            spread = "" if p.min_ms is None or p.max_ms is None else f"{p.min_ms:.2f}-{p.max_ms:.2f}"
            table.add_row(
                run.policy,
                str(p.tokens),
                f"{p.ms:.2f}",
                spread,
                f"{p.floor_ms:.2f}",
                f"{p.pct_of_floor:.1f}",
                f"{p.tokens_per_s:,.0f}",
            )
        table.add_section()
    console.print(table)
    _say_allocator(console, runs)


def _breakdown_rows(run: PolicyRun) -> list[tuple[str, StepBreakdown | None]]:
    rows = [(f"decode {d.batch}", d.breakdown) for d in run.decode]
    return rows + [(f"prefill {p.tokens}", p.breakdown) for p in run.prefill]


def _host_calls_table(runs: list[PolicyRun], per_step: int = 3) -> Table:
    """The host's heaviest calls into CUDA per measured step (under the profiler): a wait on the
    device shows as one call taking far more than a launch."""
    table = Table(title="the host's heaviest calls into CUDA (per step, under the profiler)")
    for column in ("policy", "step", "call", "calls", "ms"):
        table.add_column(column, justify="right")
    for run in runs:
        for label, b in _breakdown_rows(run):
            for name, calls, ms in () if b is None else b.host_calls[:per_step]:
                table.add_row(run.policy, label, name, f"{calls:.0f}", f"{ms:.3f}")
        table.add_section()
    return table


def _breakdown_table(runs: list[PolicyRun]) -> Table:
    from infer_cli.bench.step_profile import CATEGORIES, OTHER

    categories = [name for name, _ in CATEGORIES] + [OTHER]
    table = Table(title="where a step goes (ms per step; device busy = union of kernel time)")
    for column in ("policy", "step", "step ms", "device busy", "host gap", *categories, "kernels"):
        table.add_column(column, justify="right")
    for run in runs:
        for label, b in _breakdown_rows(run):
            if b is None:
                continue
            table.add_row(
                run.policy,
                label,
                f"{b.host_ms:.3f}",
                f"{b.busy_ms:.3f}",
                f"{b.host_gap_ms:.3f}",
                *(f"{b.category_ms(c):.3f}" for c in categories),
                f"{b.kernels_per_step:.0f}",
            )
        table.add_section()
    return table
