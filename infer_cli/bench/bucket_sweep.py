"""`infer bench --buckets`: what each decode CUDA graph costs, per bucket and numeric policy.

For one policy the model is loaded eagerly with a small KV pool (enough for the profiling step),
then, as start-up does (engine.paged_startup):
  1. a trial capture of every bucket, largest first into one shared pool: the sum of its free-memory
     drops, less what stayed resident once it was dropped (engine.cuda_graphs.TrialCapture), is the
     graph figure the engine reserves in the KV budget;
  2. the trial is dropped and every bucket captured again, the measured capture. Per bucket it
     records the drop in free device memory, the growth of the allocator's reserved memory (the
     shared pool), the graph's node count and its replay time.
Each bucket also keeps its trial figures, the first capture. What a first capture takes outside
torch's pool stays resident once its graphs are dropped, and the second capture reuses it, so only
the first shows what a graph's nodes cost (per-token's 21 buckets, up to 56k nodes each, took
1.4 GiB so on Qwen3-4B on the H200, 2026-12-02).
The budget check compares the reserved figure with the measured one, and asks which buckets fit in
what utilisation × device memory leaves after what is resident, the activation peak and the smallest KV
pool.

Node count: GraphedDecode instantiates its graphs without keeping the captured `cudaGraph_t`, so
`CUDAGraph.raw_cuda_graph()` + `cudaGraphGetNodes` is not available; instead one replay is run under
torch.profiler and its device activities are counted (CUPTI reports each kernel, memcpy and memset a
graph launch runs). That is the graph's kernel/memcpy/memset node count; empty or host nodes, if
any, are not counted.

Needs CUDA; the pure figures (engine.graph_budget) are unit-tested on the CPU.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import CaptureRecord, GraphedDecode, trial_capture
from engine.graph_budget import (
    BucketMemory,
    GraphFit,
    ReserveCheck,
    fit_buckets,
    graphs_available,
)
from engine.progress import SILENT, ProgressSink, task
from infer_cli.bench.timing import device_ms
from kernels.kv_layout import pages_for

NODE_COUNT_METHOD = "device activities of one profiled replay (torch.profiler/CUPTI)"


@dataclass(frozen=True, slots=True)
class BucketMeasurement:
    policy: str
    bucket: int
    device_bytes: int  # drop in free device memory across the capture
    pool_bytes: int  # growth of the shared pool (allocator reserved memory) across the capture
    nodes: int | None
    replay_ms: float
    capture_s: float
    first_device_bytes: int  # the same two figures at the bucket's first capture (the trial)
    first_pool_bytes: int

    def memory(self) -> BucketMemory:
        return BucketMemory(self.bucket, self.device_bytes, self.pool_bytes)

    @property
    def first_outside_pool_bytes(self) -> int:
        """What the first capture took outside torch's pool: the instantiated graph's own memory
        (its nodes), with any kernel module first loaded under capture."""
        return self.first_device_bytes - self.first_pool_bytes


@dataclass(frozen=True, slots=True)
class PolicySweep:
    policy: str
    buckets: tuple[BucketMeasurement, ...]
    check: ReserveCheck
    fit: GraphFit
    persisted_outside_bytes: int  # what the trial left resident outside torch once dropped

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "buckets": [
                asdict(m) | {"first_outside_pool_bytes": m.first_outside_pool_bytes} for m in self.buckets
            ],
            "first_capture_persisted_outside_bytes": self.persisted_outside_bytes,
            "reserved_bytes": self.check.reserved,
            "measured_bytes": self.check.measured,
            "reserved_vs_measured_pct": self.check.diff_pct,
            "graphs_available_bytes": self.fit.available,
            "buckets_that_fit": list(self.fit.fitting),
            "largest_bucket_that_fits": self.fit.largest,
        }


def sweep_json(sweeps: Sequence[PolicySweep], meta: dict[str, Any]) -> dict[str, Any]:
    return meta | {"node_count_method": NODE_COUNT_METHOD, "policies": [s.to_json() for s in sweeps]}


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _capture_measured(graphs: GraphedDecode, progress: ProgressSink, label: str) -> list[CaptureRecord]:
    """Capture every bucket; each record carries its free-memory drop and its pool growth."""
    _settle()
    records: list[CaptureRecord] = []

    def record(r: CaptureRecord) -> None:
        records.append(r)
        progress.advance(f"bucket {r.bucket}")

    with task(progress, label, len(graphs.buckets)):
        graphs.capture(on_bucket=record)
    return records


def count_graph_nodes(graph: torch.cuda.CUDAGraph) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _measure(
    policy: str, graphs: GraphedDecode, record: CaptureRecord, first: CaptureRecord
) -> BucketMeasurement:
    graph = graphs.graph_for(record.bucket)
    if graph is None:
        raise RuntimeError(f"bucket {record.bucket} was captured but has no graph")
    return BucketMeasurement(
        policy=policy,
        bucket=record.bucket,
        device_bytes=record.bytes_added,
        pool_bytes=record.pool_bytes,
        nodes=count_graph_nodes(graph),
        replay_ms=device_ms(graph.replay),
        capture_s=record.seconds,
        first_device_bytes=first.bytes_added,
        first_pool_bytes=first.pool_bytes,
    )


def sweep_policy(
    model_path: Path,
    policy: str,
    buckets: Sequence[int],
    utilization: float,
    attention_backend: str | None = None,
    progress: ProgressSink = SILENT,
) -> PolicySweep:
    """Load `model_path` under `policy` and measure every bucket's graph (see the module doc)."""
    from engine.model_runner import PagedModelRunner
    from engine.paged_startup import measure_activations
    from engine.scheduler import BatchScheduler
    from models.registry import ModelOptions, load_model

    top = max(buckets)
    defaults = EngineConfig()
    tokens = max(defaults.max_num_batched_tokens, top)
    engine = EngineConfig(
        max_num_seqs=top,
        max_num_batched_tokens=tokens,
        enforce_eager=True,  # the sweep captures itself
        num_kv_pages=pages_for(tokens) + 2,  # room for the profiling step only
        enable_prefix_caching=False,
        gpu_memory_utilization=utilization,
        numeric_policy=policy,
    )
    loaded = load_model(
        str(model_path),
        ModelOptions(engine=engine, device="cuda", attention_backend=attention_backend, progress=progress),
    )
    scheduler = loaded.scheduler
    if not isinstance(scheduler, BatchScheduler) or not isinstance(scheduler.runner, PagedModelRunner):
        raise ValueError(f"{model_path}: not a paged model line")
    model, attention = scheduler.runner.model, scheduler.runner.attention
    if policy != "tuned" and getattr(model, "linear", None) is None:
        # A line that ignores the policy would measure tuned under every name.
        raise ValueError(
            f"{model_path}: its model line does not take a numeric policy (asked for {policy!r})"
        )
    max_pages = pages_for(loaded.max_model_len)
    per_page = model.kv.bytes_per_page()
    kv_min = 2 * sum(per_page)
    # What the loaded pools hold, each group at its own count, so `weights` excludes all of it.
    kv_now = sum(n * size for n, size in zip(model.kv.num_pages, per_page, strict=True))

    _settle()
    activation_peak = measure_activations(model, attention, engine)
    total = torch.cuda.get_device_properties(model.device).total_memory

    trial = trial_capture(
        GraphedDecode(model, attention, sorted(buckets), max_pages),
        lambda g: _capture_measured(g, progress, f"{policy}: first capture"),
        policy,
    )
    _settle()
    # As start-up reads it: what stays resident, less the KV pool loaded for profiling (the
    # engine sizes its pool after dropping that one) and less what the trial left (in its records).
    free, _ = torch.cuda.mem_get_info()
    resident = total - free - kv_now - trial.persisted_outside

    first = {r.bucket: r for r in trial.records}
    graphs = GraphedDecode(model, attention, sorted(buckets), max_pages)
    measured: list[BucketMeasurement] = []
    records = sorted(_capture_measured(graphs, progress, f"{policy}: second capture"), key=lambda r: r.bucket)
    with task(progress, f"{policy}: nodes and replay time", len(records)):
        for record in records:
            measured.append(_measure(policy, graphs, record, first[record.bucket]))
            progress.advance(f"bucket {record.bucket}")

    check = ReserveCheck(trial.reserve_bytes, sum(m.device_bytes for m in measured))
    available = graphs_available(total, utilization, resident, activation_peak, kv_min)
    fit = fit_buckets([m.memory() for m in measured], available)
    del graphs, model, attention, scheduler, loaded
    _settle()
    return PolicySweep(policy, tuple(measured), check, fit, trial.persisted_outside)
