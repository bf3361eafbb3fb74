"""Bringing a paged model up on its device: profile, measure graphs, size the KV pool, capture.

On CUDA, in order: (1) a small KV pool and a profiling forward of the largest step (the token
budget in one prefill, `max_num_seqs` rows sampled) measure the activation peak; (2) the decode
graphs are captured once against that small pool to measure what they take, then dropped; (3) the
KV pool is sized from utilisation × device memory minus weights, activations and graphs; (4) the
graphs are captured again against the real pool, and the log compares the graph estimate with
what they took. On CPU the pool gets a fixed allowance and nothing is captured.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from engine.config import EngineConfig
from engine.contract import SamplingParams
from engine.cuda_graphs import CaptureRecord, GraphedDecode, decode_buckets
from engine.forward_batch import PagedCausalLM
from engine.graph_budget import BucketMemory, graphs_available, require_fit
from engine.memory_budget import CPU_KV_BYTES, GIB, MemoryBudget
from engine.model_runner import PagedModelRunner, build_forward_batch
from engine.runner import BatchRow
from engine.sampling import sample
from engine.sampling_batch import RowSampling, SamplingBatch, SamplingPlan
from kernels.attention.base import AttentionBackend

log = logging.getLogger("infer.startup")


@dataclass(frozen=True, slots=True)
class StartupReport:
    kv_pages: int
    budget: MemoryBudget | None
    graph_estimate: int
    graph_actual: int
    captures: tuple[CaptureRecord, ...]


def _configured_pages(config: EngineConfig, per_page: int) -> int | None:
    """--num-kv-pages, else --kv-cache-memory in pages; None: size from the measured budget."""
    if config.num_kv_pages is not None:
        return config.num_kv_pages
    if config.kv_cache_memory is not None:
        return max(2, config.kv_cache_memory // per_page)
    return None


def _profile_pages(config: EngineConfig) -> int:
    return -(-config.max_num_batched_tokens // config.page_size) + 2


def profile_step(model: PagedCausalLM, attention: AttentionBackend, config: EngineConfig) -> None:
    """The largest eager step: the whole token budget as one prefill, every sampled row through the
    most demanding sampler plan (filters and 20 log-probs)."""
    tokens = config.max_num_batched_tokens
    pages = tuple(range(1, 1 + -(-tokens // config.page_size)))
    row = BatchRow(
        "profile",
        (0,) * tokens,
        0,
        (pages,) * len(model.attention_specs),
        True,
        SamplingParams(),
        [0] * tokens,
        0,
    )
    with torch.inference_mode():
        fb = build_forward_batch([row], model.page_size, model.attention_specs, model.device, attention)
        rows = min(tokens, config.max_num_seqs)
        fb.sample_index = torch.arange(tokens - rows, tokens, device=model.device)
        logits = model.logits(model.forward(fb))
        params = SamplingBatch.pack(
            [RowSampling(SamplingParams(top_p=0.9, top_k=50, logprobs=20), 0, 0)] * rows
        )
        sample(logits, params.to(model.device), SamplingPlan.for_graph(20))
    torch.cuda.synchronize()


def _capture(graphs: GraphedDecode, console: Console, label: str) -> None:
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("bucket {task.fields[bucket]:>3}"),
        TextColumn("free {task.fields[free]:.1f} GiB"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        free, _ = torch.cuda.mem_get_info()
        task = progress.add_task(label, total=len(graphs.buckets), bucket=graphs.max_bucket, free=free / GIB)

        def advance(record: CaptureRecord) -> None:
            progress.update(task, advance=1, bucket=record.bucket, free=record.free_after / GIB)

        graphs.capture(on_bucket=advance)


def start_paged_model(
    model: PagedCausalLM,
    attention: AttentionBackend,
    config: EngineConfig,
    max_model_len: int,
    console: Console | None = None,
) -> tuple[PagedModelRunner, StartupReport]:
    console = console or Console(stderr=True)
    device = model.device
    per_page = model.kv_bytes_per_page()
    if device.type != "cuda":
        pages = config.num_kv_pages or max(2, (config.kv_cache_memory or CPU_KV_BYTES) // per_page)
        model.allocate_kv(pages)
        return PagedModelRunner(model, attention), StartupReport(pages, None, 0, 0, ())

    max_pages_per_seq = -(-max_model_len // config.page_size)
    use_graphs = not config.enforce_eager and attention.supports_graphs
    buckets = decode_buckets(config.max_num_seqs)
    total = torch.cuda.get_device_properties(device).total_memory
    weights = torch.cuda.memory_allocated(device)

    model.allocate_kv(_profile_pages(config))
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile_step(model, attention, config)
    activation_peak = torch.cuda.max_memory_allocated(device) - before

    graph_estimate = 0
    if use_graphs:
        trial = GraphedDecode(model, attention, buckets, max_pages_per_seq)
        _capture(trial, console, "measuring decode graphs")
        graph_estimate = sum(r.bytes_added for r in trial.records)
        # A configuration whose graphs cannot fit is refused here, naming the largest bucket that
        # does, never by an out-of-memory error later.
        require_fit(
            [BucketMemory(r.bucket, r.bytes_added, r.pool_bytes) for r in trial.records],
            graphs_available(total, config.gpu_memory_utilization, weights, activation_peak, 2 * per_page),
            config.numeric_policy,
        )
        del trial
        gc.collect()
    model.allocate_kv(2)  # drop the profiling pool before sizing the real one
    torch.cuda.empty_cache()

    budget = MemoryBudget(total, config.gpu_memory_utilization, weights, activation_peak, graph_estimate)
    pages = _configured_pages(config, per_page) or budget.pages(per_page)
    model.allocate_kv(pages)
    graphs: GraphedDecode | None = None
    if use_graphs:
        graphs = GraphedDecode(model, attention, buckets, max_pages_per_seq)
        _capture(graphs, console, "capturing decode graphs")
    actual = sum(r.bytes_added for r in graphs.records) if graphs else 0
    message = budget.describe(pages, config.page_size)
    if graphs is not None:
        message += f"; graph memory estimate {graph_estimate / GIB:.3f} GiB, actual {actual / GIB:.3f} GiB"
    log.info(message)
    console.print(message)
    report = StartupReport(pages, budget, graph_estimate, actual, tuple(graphs.records) if graphs else ())
    return PagedModelRunner(model, attention, graphs=graphs), report
