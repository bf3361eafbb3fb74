"""Bringing a paged model up on its device: profile, measure graphs, size the KV pool, capture.

On CUDA, in order: (0) the attention kernels are built (FlashInfer compiles on first use), with a
progress bar; (1) a small KV pool and two profiling steps (a decode-shaped one, then the token
budget in one prefill) measure what a step's transient tensors take (`measure_activations`);
(2) the decode graphs are captured once against that small pool to measure what they take, then
dropped (`engine.cuda_graphs.trial_capture`); (3) with the profiling pool dropped, the memory then
resident is read off the device, and the KV pool is sized from utilisation × device memory minus
that, the activations and the graphs; (4) the graphs are captured again against the real pool, and
the log compares the graph estimate with what they took. On CPU the pool gets a fixed allowance
and nothing is captured.

Each KV group gets its own page count (`split_kv_bytes`, `split_kv_pages`): a sliding group never
holds more than `KVGroupSpec.max_live_pages` pages for one request, so it gets what
`max_num_seqs` such requests hold at once (plus the padding page), never more than the full
groups get; the full groups, which hold the whole context, take the rest of the bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from engine.config import EngineConfig
from engine.contract import SamplingParams
from engine.cuda_graphs import CaptureRecord, GraphedDecode, TrialCapture, decode_buckets, trial_capture
from engine.forward_batch import PagedCausalLM
from engine.graph_budget import BucketMemory, graphs_available, require_fit
from engine.kv.spec import KVGroupSpec
from engine.memory_budget import CPU_KV_BYTES, GIB, MemoryBudget
from engine.model_runner import PagedModelRunner, build_forward_batch
from engine.runner import BatchRow
from engine.sampling import sample
from engine.sampling_batch import RowSampling, SamplingBatch, SamplingPlan
from kernels.attention.base import AttentionBackend, AttentionLayerSpec

log = logging.getLogger("infer.startup")


@dataclass(frozen=True, slots=True)
class StartupReport:
    # Per KV group, in the model's `attention_specs` order; page 0 (padding) included.
    kv_pages: tuple[int, ...]
    budget: MemoryBudget | None
    graph_estimate: int
    graph_actual: int
    captures: tuple[CaptureRecord, ...]


@dataclass(frozen=True, slots=True)
class KVGroupCost:
    """What sizing needs of one KV group: the bytes one page id costs across its layers, and, for
    a sliding group, the most pages it can ever need (padding page included); None: a full group,
    which needs as many pages as the context it holds."""

    bytes_per_page: int
    sliding_need: int | None = None

    def __post_init__(self) -> None:
        if self.bytes_per_page < 1:
            raise ValueError(f"bytes_per_page must be at least 1, got {self.bytes_per_page}")
        if self.sliding_need is not None and self.sliding_need < 2:
            raise ValueError(f"sliding_need must be at least 2 (page 0 is padding), got {self.sliding_need}")


def sliding_need(
    window: int, page_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """Pages a sliding group needs so that `max_num_seqs` requests can each hold the most pages one
    request ever holds (the scheduler's own bound, `KVGroupSpec.max_live_pages`), plus page 0."""
    spec = KVGroupSpec("sliding", 2, page_size, sliding_window=window)
    return max_num_seqs * spec.max_live_pages(max_model_len, max_num_batched_tokens) + 1


def split_kv_pages(full_pages: int, groups: Sequence[KVGroupCost]) -> tuple[int, ...]:
    """Page counts when the full groups' count is given (`--num-kv-pages`): every full group gets
    `full_pages`, a sliding group its need capped at `full_pages`. The cap keeps a sliding group
    from ever being the one that refuses a request: either it holds `max_num_seqs` requests'
    worth, or as many pages as the full groups, and a request never needs more sliding pages
    than full ones."""
    if full_pages < 2:
        raise ValueError(f"full_pages must be at least 2 (page 0 is padding), got {full_pages}")
    return tuple(full_pages if g.sliding_need is None else min(g.sliding_need, full_pages) for g in groups)


def _bytes_at(full_pages: int, groups: Sequence[KVGroupCost]) -> int:
    return sum(g.bytes_per_page * n for g, n in zip(groups, split_kv_pages(full_pages, groups), strict=True))


def split_kv_bytes(kv_bytes: int, groups: Sequence[KVGroupCost]) -> tuple[int, ...]:
    """Page counts for `kv_bytes` of KV across all groups: the largest full-group count F whose
    `split_kv_pages(F)` fits, so the sliding groups take their need (capped at F) and the full
    groups the rest. At least 2 pages per group, as a one-count pool always had. A model with no
    sliding group gets `kv_bytes // bytes_per_page`, as before; one with no full group gets
    exactly its sliding needs (more could never be used)."""
    if not groups:
        raise ValueError("a model needs at least one KV group, got none")
    if kv_bytes < 0:
        raise ValueError(f"kv_bytes must not be negative, got {kv_bytes}")
    full_bytes = sum(g.bytes_per_page for g in groups if g.sliding_need is None)
    # Sliding pages cost bytes too, so F never exceeds what the full groups alone could take; with
    # no full group, F past the largest sliding need changes nothing.
    hi = max(2, kv_bytes // full_bytes) if full_bytes else max(g.sliding_need or 2 for g in groups)
    # The bytes split_kv_pages(F) takes grow with F: binary search for the largest F that fits.
    lo = 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _bytes_at(mid, groups) <= kv_bytes:
            lo = mid
        else:
            hi = mid - 1
    return split_kv_pages(lo, groups)


def kv_group_costs(model: PagedCausalLM, config: EngineConfig, max_model_len: int) -> tuple[KVGroupCost, ...]:
    """Each of the model's KV groups, as sizing sees it (sliding: `attention_specs[g].window`)."""
    per_page = model.kv_group_bytes_per_page()
    if len(per_page) != len(model.attention_specs):
        raise ValueError(
            f"the model reports page bytes for {len(per_page)} KV groups but has "
            f"{len(model.attention_specs)} attention specs"
        )
    return tuple(
        KVGroupCost(
            size,
            None
            if spec.window is None
            else sliding_need(
                spec.window,
                model.page_size,
                max_model_len,
                config.max_num_seqs,
                config.max_num_batched_tokens,
            ),
        )
        for size, spec in zip(per_page, model.attention_specs, strict=True)
    )


def configured_kv_pages(config: EngineConfig, groups: Sequence[KVGroupCost]) -> tuple[int, ...] | None:
    """--num-kv-pages (the full groups' count), else --kv-cache-memory (bytes over all groups);
    None: size from the measured budget."""
    if config.num_kv_pages is not None:
        return split_kv_pages(config.num_kv_pages, groups)
    if config.kv_cache_memory is not None:
        return split_kv_bytes(config.kv_cache_memory, groups)
    return None


def _describe_groups(pages: Sequence[int], groups: Sequence[KVGroupCost]) -> str:
    return ", ".join(
        f"{'sliding' if g.sliding_need is not None else 'full'} group {i}: {n} pages"
        for i, (n, g) in enumerate(zip(pages, groups, strict=True))
    )


def _profile_pages(config: EngineConfig) -> int:
    return -(-config.max_num_batched_tokens // config.page_size) + 2


def profile_step(
    model: PagedCausalLM, attention: AttentionBackend, config: EngineConfig, tokens: int | None = None
) -> None:
    """An eager step of `tokens` tokens (default: the token budget) as one prefill, its last
    min(tokens, max_num_seqs) positions sampled through the most demanding sampler plan (filters
    and 20 log-probs)."""
    tokens = config.max_num_batched_tokens if tokens is None else tokens
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


def measure_activations(model: PagedCausalLM, attention: AttentionBackend, config: EngineConfig) -> int:
    """Bytes to reserve for a step's transient tensors: the larger of the allocated peak and what
    the allocator still holds after a decode-shaped step (`max_num_seqs` rows sampled) and then the
    largest prefill. Serving alternates those two shapes, and blocks cut for one need not fit the
    other: on the H200 the cache grew to 3.58 GiB behind a 3.00 GiB peak on Gemma 4 12B
    (docs/benchmarks/numerics.md). The allocator's cache is emptied first, so what it holds after
    is these steps' own."""
    device = model.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    profile_step(model, attention, config, tokens=min(config.max_num_seqs, config.max_num_batched_tokens))
    profile_step(model, attention, config)
    peak = torch.cuda.max_memory_allocated(device) - allocated
    held = torch.cuda.memory_reserved(device) - reserved
    return max(peak, held)


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


def warm_up_attention(
    attention: AttentionBackend, specs: Sequence[AttentionLayerSpec], page_size: int, console: Console
) -> None:
    """Build the attention kernels the model needs before anything is measured, one progress row
    per kernel: FlashInfer compiles each on first use on this machine (a minute or more), which
    would otherwise be a silent stall inside the profiling step."""
    steps = attention.warm_up_steps(specs, page_size)
    if not steps:
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(
            f"building {attention.name} kernels (cached after the first run)", total=len(steps)
        )
        for step in steps:
            progress.update(task, description=f"building {attention.name} {step.description}")
            started = time.perf_counter()
            step.run()
            log.info("%s %s ready in %.1f s", attention.name, step.description, time.perf_counter() - started)
            progress.advance(task)


def start_paged_model(
    model: PagedCausalLM,
    attention: AttentionBackend,
    config: EngineConfig,
    max_model_len: int,
    console: Console | None = None,
) -> tuple[PagedModelRunner, StartupReport]:
    console = console or Console(stderr=True)
    device = model.device
    groups = kv_group_costs(model, config, max_model_len)
    per_page = sum(g.bytes_per_page for g in groups)
    if device.type != "cuda":
        pages = configured_kv_pages(config, groups) or split_kv_bytes(CPU_KV_BYTES, groups)
        model.allocate_kv(pages)
        return PagedModelRunner(model, attention), StartupReport(pages, None, 0, 0, ())

    max_pages_per_seq = -(-max_model_len // config.page_size)
    use_graphs = not config.enforce_eager and attention.supports_graphs
    buckets = decode_buckets(config.max_num_seqs)
    total = torch.cuda.get_device_properties(device).total_memory
    # Overlapped prefill plans on its own attention instance (its own workspace): made now so the
    # "weights" figure below, everything resident before profiling, includes it.
    side_attention = attention.sibling() if config.async_prefill else None
    weights = torch.cuda.memory_allocated(device)

    warm_up_attention(attention, model.attention_specs, model.page_size, console)
    model.allocate_kv([_profile_pages(config)] * len(groups))
    activation_peak = measure_activations(model, attention, config)

    trial: TrialCapture | None = None
    if use_graphs:
        trial = trial_capture(
            GraphedDecode(model, attention, buckets, max_pages_per_seq),
            lambda g: _capture(g, console, "measuring decode graphs"),
            config.numeric_policy,
        )
    model.allocate_kv([2] * len(groups))  # drop the profiling pool before sizing the real one
    torch.cuda.empty_cache()
    # Everything that stays is read off the device rather than summed from earlier figures: the
    # weights, what the warm-up, the profiling step and the trial left behind (FlashInfer's
    # graph-mode index buffers, library workspaces, kernel modules), the CUDA context, and other
    # processes on the device. Summing terms measured at different moments missed ~1 GiB of this on
    # the H200 (docs/benchmarks/numerics.md).
    free, _ = torch.cuda.mem_get_info(device)
    resident = total - free
    graph_estimate = trial.reserve_bytes if trial is not None else 0
    if trial is not None:
        # A configuration whose graphs cannot fit is refused here, naming the largest bucket that
        # does, never by an out-of-memory error later. The trial's records include what stayed
        # resident, so it is taken out of `resident` to be counted once.
        require_fit(
            [BucketMemory(r.bucket, r.bytes_added, r.pool_bytes) for r in trial.records],
            graphs_available(
                total,
                config.gpu_memory_utilization,
                resident - trial.persisted_outside,
                activation_peak,
                2 * per_page,
            ),
            config.numeric_policy,
        )

    budget = MemoryBudget(
        total, config.gpu_memory_utilization, weights, activation_peak, graph_estimate, resident - weights
    )
    configured = configured_kv_pages(config, groups)
    if configured is None:
        budget.pages(per_page)  # refuses, naming every term, when not even 2 pages per group fit
        configured = split_kv_bytes(budget.kv_bytes, groups)
    pages = configured
    model.allocate_kv(pages)
    graphs: GraphedDecode | None = None
    if use_graphs:
        graphs = GraphedDecode(model, attention, buckets, max_pages_per_seq)
        graphs.reserved = trial
        _capture(graphs, console, "capturing decode graphs")
    actual = graphs.captured_bytes if graphs else 0
    # The context a request can reach is what the full groups hold (all of them when none is).
    context = min(
        (n for n, g in zip(pages, groups, strict=True) if g.sliding_need is None), default=max(pages)
    )
    message = budget.describe(context, config.page_size) + f" ({_describe_groups(pages, groups)})"
    if graphs is not None:
        message += f"; graph memory estimate {graph_estimate / GIB:.3f} GiB, actual {actual / GIB:.3f} GiB"
        if trial is not None and trial.persisted_outside:
            message += f" (the trial took {trial.captured_bytes / GIB:.3f} GiB, of which {trial.persisted_outside / GIB:.3f} GiB stayed resident)"
    log.info(message)
    console.print(message)
    report = StartupReport(pages, budget, graph_estimate, actual, tuple(graphs.records) if graphs else ())
    return PagedModelRunner(model, attention, graphs=graphs, side_attention=side_attention), report
