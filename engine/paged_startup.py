"""Bringing a paged model up on its device: measure, size each KV group, capture the decode graphs.

On CUDA, in order: the attention kernels are built (FlashInfer compiles on first use); a small pool
and two profiling steps measure what a step's transient tensors take (`measure_activations`); the
decode graphs (and with `--prefill-graphs` the prefill graphs, engine/prefill_graphs.py) are
captured once to measure them, then dropped (`cuda_graphs.trial_capture`); the KV pools are sized
from what is resident then (engine.memory_budget, engine.kv.sizing); the graphs are captured again
against the real pools. On CPU the pools get a fixed allowance and nothing is captured.
docs/engine.md tells the story and the measurements behind each step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.contract import SamplingParams
from engine.cuda_graphs import (
    CapturedGraphs,
    CaptureRecord,
    GraphedDecode,
    TrialCapture,
    decode_buckets,
    trial_capture,
)
from engine.forward_batch import PagedCausalLM
from engine.graph_budget import BucketMemory, graphs_available, require_fit
from engine.kv.sizing import configured_kv_pages, group_costs, snapshot_slots, split_kv_bytes
from engine.kv.spec import KVGroupSpec
from engine.kv.state_pool import state_pools_of
from engine.memory_budget import CPU_KV_BYTES, GIB, MemoryBudget
from engine.model_runner import PagedModelRunner
from engine.parallel.group import SINGLE_RANK, RankGroup
from engine.prefill_graphs import PrefillGraphs, fillable_tokens, prefill_buckets, refuse_unless_supported
from engine.progress import SILENT, ProgressSink, task
from engine.runner import BatchRow
from engine.sampling import sample
from engine.sampling_batch import RowSampling, SamplingBatch, SamplingPlan
from engine.step_packer import pack_step
from kernels.attention.base import AttentionBackend, AttentionLayerSpec
from kernels.kv_layout import PAGE_SIZE, pages_for

log = logging.getLogger("infer.startup")


def _profile_pages(config: EngineConfig) -> int:
    return pages_for(config.max_num_batched_tokens) + 2


def profile_step(
    model: PagedCausalLM, attention: AttentionBackend, config: EngineConfig, tokens: int | None = None
) -> None:
    """An eager step of `tokens` tokens (default: the token budget) as one prefill, its last
    min(tokens, max_num_seqs) positions sampled through the most demanding sampler plan (filters
    and 20 log-probs); with `--sampling-backend triton`, then one row through each cheaper plan that
    draws, so that every variant of the draw kernel is compiled before the first request needs it."""
    tokens = config.max_num_batched_tokens if tokens is None else tokens
    specs = model.kv.attention_specs
    pages = tuple(range(1, 1 + pages_for(tokens)))
    row = BatchRow.whole_prompt("profile", (0,) * tokens, (pages,) * len(specs))
    rows = min(tokens, config.max_num_seqs)
    with torch.inference_mode():
        step = pack_step([row], specs, attention, logits_last=rows)
        logits = model.logits(model.forward(step.to(model.device)))
        params = SamplingBatch.pack(
            [RowSampling(SamplingParams(top_p=0.9, top_k=50, logprobs=20), 0, 0)] * rows
        )
        sample(logits, params.to(model.device), SamplingPlan.widest(20), triton_draw=config.triton_draw)
        if config.triton_draw:
            one_row = SamplingBatch.pack([RowSampling(SamplingParams(), 0, 0)]).to(model.device)
            for sorted_filters, min_p_filter in ((False, False), (False, True), (True, False)):
                plan = SamplingPlan(sorted_filters=sorted_filters, min_p_filter=min_p_filter)
                sample(logits[:1], one_row, plan, triton_draw=True)
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


def _capture(graphs: CapturedGraphs, progress: ProgressSink, label: str) -> None:
    def advance(record: CaptureRecord) -> None:
        progress.advance(f"bucket {record.bucket}, {record.free_after / GIB:.1f} GiB free")

    with task(progress, label, len(graphs.buckets)):
        graphs.capture(on_bucket=advance)


def warm_up_attention(
    attention: AttentionBackend, specs: Sequence[AttentionLayerSpec], progress: ProgressSink
) -> None:
    """Build the attention kernels the model needs before anything is measured: FlashInfer compiles
    each on first use on this machine (a minute or more), which would otherwise be a silent stall
    inside the profiling step."""
    steps = attention.warm_up_steps(specs, PAGE_SIZE)
    if not steps:
        return
    with task(progress, f"building {attention.name} kernels (cached after the first run)", len(steps)):
        for step in steps:
            progress.advance(step.description, amount=0)
            started = time.perf_counter()
            step.run()
            log.info("%s %s ready in %.1f s", attention.name, step.description, time.perf_counter() - started)
            progress.advance()


def _describe(groups: Sequence[KVGroupSpec]) -> str:
    return ", ".join(f"{g.name}: {g.num_pages} pages" for g in groups)


def allocate_state_slots(model: PagedCausalLM, config: EngineConfig, progress: ProgressSink) -> None:
    """A recurrent model's state pool: one slot per running request (`--max-num-seqs`) plus the
    padding slot, and the prefix cache's snapshot slots (`kv.sizing.snapshot_slots`). Allocated
    before the KV budget is read, so its bytes are resident there."""
    state = state_pools_of(model)
    if state is None:
        return
    slots = config.max_num_seqs + 1
    snapshots = snapshot_slots(config)
    state.allocate(slots, snapshots)
    total = slots + snapshots
    message = (
        f"state slots: {total} ({config.max_num_seqs} for --max-num-seqs + the padding slot + "
        f"{snapshots} prefix-cache snapshots) × {state.bytes_per_slot() / 2**20:.2f} MiB = "
        f"{total * state.bytes_per_slot() / GIB:.3f} GiB"
    )
    log.info(message)
    progress.note(message)


def start_paged_model(
    model: PagedCausalLM,
    attention: AttentionBackend,
    config: EngineConfig,
    max_model_len: int,
    progress: ProgressSink = SILENT,
    group: RankGroup = SINGLE_RANK,
) -> tuple[PagedModelRunner, tuple[KVGroupSpec, ...]]:
    """The runner over `model`, and the scheduler's KV groups, each at the page count start-up gave
    it (page 0 included). Under tensor parallelism every rank sizes its own pools and all take the
    smallest count any rank can hold, so a page id means the same thing on every rank."""
    device = model.device
    kv = model.kv
    triton_draw = config.triton_draw
    groups = group_costs(kv.shapes, kv.bytes_per_page(), config, max_model_len)
    per_page = sum(g.bytes_per_page for g in groups)
    if device.type != "cuda":
        allocate_state_slots(model, config, progress)
        kv.allocate(
            group.min_over_ranks(configured_kv_pages(config, groups) or split_kv_bytes(CPU_KV_BYTES, groups))
        )
        return PagedModelRunner(model, attention, triton_draw=triton_draw), kv.specs()

    max_pages_per_seq = pages_for(max_model_len)
    # Under tensor parallelism every rank runs this same start-up, so each captures the same buckets
    # in the same order and its graphs hold its side of the collectives (NCCL; docs/tensor-parallel.md).
    use_graphs = not config.enforce_eager and attention.supports_graphs
    buckets = decode_buckets(config.max_num_seqs)
    use_prefill_graphs = use_graphs and config.prefill_graphs
    if config.prefill_graphs and not use_graphs:
        log.warning(
            "--prefill-graphs does nothing here: no CUDA graphs are captured (--enforce-eager, or an "
            "attention backend that cannot be captured)"
        )
    if use_prefill_graphs:
        refuse_unless_supported(model)
    # No step holds more tokens than its rows can: a short context limit caps the largest bucket.
    token_buckets = prefill_buckets(
        min(config.max_num_batched_tokens, fillable_tokens(config.max_num_seqs, max_pages_per_seq))
    )
    total = torch.cuda.get_device_properties(device).total_memory
    # Overlapped prefill plans on its own attention instance (its own workspace): made now so the
    # "weights" figure below, everything resident before profiling, includes it.
    side_attention = attention.sibling() if config.async_prefill else None
    weights = torch.cuda.memory_allocated(device)
    # After `weights` is read: the state pool counts among what stays resident beside the KV.
    allocate_state_slots(model, config, progress)

    warm_up_attention(attention, kv.attention_specs, progress)
    kv.allocate([_profile_pages(config)] * len(groups))
    activation_peak = measure_activations(model, attention, config)

    trial: TrialCapture | None = None
    if use_graphs:
        trial = trial_capture(
            GraphedDecode(model, attention, buckets, max_pages_per_seq),
            lambda g: _capture(g, progress, "measuring decode graphs"),
            config.numeric_policy,
        )
    prefill_trial: TrialCapture | None = None
    prefill_static: list[int] = []  # read inside the trial: only `trial_capture` may hold its graphs
    configured = configured_kv_pages(config, groups)
    # Measured only where the KV pool is sized from what is left (a configured page count is not).
    if use_prefill_graphs and configured is None:

        def measure_prefill(graphs: PrefillGraphs) -> None:
            _capture(graphs, progress, "measuring prefill graphs")
            prefill_static.append(graphs.static_bytes)  # complete once a bucket has run

        prefill_trial = trial_capture(
            PrefillGraphs(model, attention, token_buckets, config.max_num_seqs, max_pages_per_seq),
            measure_prefill,
            config.numeric_policy,
            kind="prefill",
        )
    kv.allocate([2] * len(groups))  # drop the profiling pool before sizing the real one
    torch.cuda.empty_cache()
    # What stays resident is read off the device rather than summed from earlier figures
    # (docs/engine.md): summing terms measured at different moments missed ~1 GiB on the H200.
    free, _ = torch.cuda.mem_get_info(device)
    resident = total - free
    graph_estimate = trial.reserve_bytes if trial is not None else 0
    if prefill_trial is not None:
        # Their own pool beside the decode graphs', and their static buffers; what their trial
        # left resident is in `resident`.
        graph_estimate += prefill_trial.reserve_bytes + sum(prefill_static)
    if trial is not None:
        # Graphs that cannot fit are refused here, naming the largest bucket that does. The trial's
        # records include what stayed resident, so it is taken out of `resident` to count once.
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
    pages = configured
    if pages is None:
        budget.pages(per_page)  # refuses, naming every term, when not even 2 pages per group fit
        pages = split_kv_bytes(budget.kv_bytes, groups)
    pages = tuple(group.min_over_ranks(pages))
    kv.allocate(pages)
    graphs: GraphedDecode | None = None
    if use_graphs:
        graphs = GraphedDecode(model, attention, buckets, max_pages_per_seq)
        graphs.reserved = trial
        _capture(graphs, progress, "capturing decode graphs")
    prefill_graphs: PrefillGraphs | None = None
    if use_prefill_graphs:
        prefill_graphs = PrefillGraphs(
            model, attention, token_buckets, config.max_num_seqs, max_pages_per_seq
        )
        _capture(prefill_graphs, progress, "capturing prefill graphs")
    actual = (graphs.captured_bytes if graphs else 0) + (
        prefill_graphs.captured_bytes if prefill_graphs else 0
    )
    kv_groups = kv.specs()
    # The context a request can reach is what the full groups hold (all of them when none is).
    context = min((g.num_pages for g in kv_groups if g.sliding_window is None), default=max(pages))
    message = f"{budget.describe(context, PAGE_SIZE)} ({_describe(kv_groups)})"
    if graphs is not None:
        message += f"; graph memory estimate {graph_estimate / GIB:.3f} GiB, actual {actual / GIB:.3f} GiB"
        if trial is not None and trial.persisted_outside:
            message += f" (the trial took {trial.captured_bytes / GIB:.3f} GiB, of which {trial.persisted_outside / GIB:.3f} GiB stayed resident)"
    log.info(message)
    progress.note(message)
    runner = PagedModelRunner(
        model,
        attention,
        graphs=graphs,
        prefill_graphs=prefill_graphs,
        side_attention=side_attention,
        triton_draw=triton_draw,
    )
    return runner, kv_groups
