"""Timing of the fused attention-prep kernel against the device's copy bandwidth (`infer bench kernels`).

The kernel is memory-bound, so its figure of merit is achieved bandwidth: bytes = every input
read once + every output written once (Q, K, V in; Q and the gate out; K and V into their slots;
positions, page-table entries and rope rows), over the kernel's median time. The yardstick is a
device-to-device copy measured in the same run, counting read + write.

Each launch is captured in a CUDA graph and its replay timed (`timing.device_ms`, which flushes the
L2 cache before every replay). The graph keeps the Python launch overhead out of the GPU timeline,
so decode sizes time the kernel, not the host.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from gates.harness.prep_workload import PrepBatch, SequenceRows, build_batch
from infer_cli.bench.timing import copy_gb_per_s as copy_bandwidth
from infer_cli.bench.timing import cuda_device, graph_us, versions
from kernels.reference import (
    PrepSpec,
    gemma4_global_prep,
    gemma4_sliding_prep,
    qwen3_prep,
    qwen35_full_attention_prep,
)

DECODE_ROWS = (1, 8, 64, 256)
PREFILL_ROWS = (2048, 8192, 16384)
_INDEX_BYTES = 4  # int32 positions, sequence indices and page-table entries


@dataclass(slots=True, frozen=True)
class BenchVariant:
    """One attention family at one model's head counts."""

    label: str
    spec: PrepSpec
    q_heads: int
    kv_heads: int


BENCH_VARIANTS: tuple[BenchVariant, ...] = (
    BenchVariant("qwen3-4b", qwen3_prep(), 32, 8),
    BenchVariant("qwen3.5-4b-full", qwen35_full_attention_prep(), 16, 4),
    BenchVariant("gemma4-12b-sliding", gemma4_sliding_prep(), 16, 8),
    BenchVariant("gemma4-12b-global", gemma4_global_prep(), 16, 1),
    BenchVariant("gemma4-31b-global", gemma4_global_prep(), 32, 4),
)


@dataclass(slots=True, frozen=True)
class KernelTiming:
    variant: str
    phase: str
    rows: int
    median_us: float
    bytes_moved: int
    gb_per_s: float
    copy_fraction: float


@dataclass(slots=True, frozen=True)
class KernelBenchResult:
    device: str
    dtype: str
    copy_gb_per_s: float
    timings: tuple[KernelTiming, ...]
    measured_at: str

    def to_json(self) -> dict[str, object]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "copy_gb_per_s": self.copy_gb_per_s,
            "measured_at": self.measured_at,
            **versions(),
            "timings": [asdict(timing) for timing in self.timings],
        }


def prep_bytes(variant: BenchVariant, rows: int, dtype: torch.dtype) -> int:
    """Bytes one launch must move at minimum: each input read once, each output written once."""
    spec = variant.spec
    element = torch.empty((), dtype=dtype).element_size()
    head = spec.head_dim * element
    q_in = variant.q_heads * spec.q_width * element
    kv_in = variant.kv_heads * head * (2 if spec.takes_v else 1)
    q_out = variant.q_heads * head * (2 if spec.q_gated else 1)
    kv_out = 2 * variant.kv_heads * head
    rope = 2 * spec.rope.turning_pairs * element
    per_row = q_in + kv_in + q_out + kv_out + rope + 3 * _INDEX_BYTES
    weights = 2 * head
    return rows * per_row + weights


def _bench_batch(
    variant: BenchVariant, phase: str, rows: int, device: torch.device, dtype: torch.dtype
) -> PrepBatch:
    if phase == "prefill":
        sequences = [SequenceRows(start_position=0, length=rows)]
    else:
        generator = torch.Generator().manual_seed(rows)
        starts = torch.randint(0, 8192, (rows,), generator=generator).tolist()
        sequences = [SequenceRows(start_position=int(p), length=1) for p in starts]
    return build_batch(
        variant.spec, variant.q_heads, variant.kv_heads, sequences, dtype=dtype, device=device, layers=1
    )


def time_prep(
    variant: BenchVariant,
    phase: str,
    rows: int,
    device: torch.device,
    dtype: torch.dtype,
    copy_gb_per_s: float,
) -> KernelTiming:
    from kernels.triton import attention_prep

    batch = _bench_batch(variant, phase, rows, device, dtype)

    def launch() -> None:
        attention_prep(
            batch.spec,
            batch.q,
            batch.k,
            batch.v,
            batch.q_norm_weight,
            batch.k_norm_weight,
            batch.rows,
            batch.rope_table,
            batch.pool_layer,
            batch.q_out,
            batch.gate_out,
        )

    ms = graph_us([launch]) / 1e3
    moved = prep_bytes(variant, rows, dtype)
    gb_per_s = moved / (ms * 1e-3) / 1e9
    return KernelTiming(
        variant=variant.label,
        phase=phase,
        rows=rows,
        median_us=ms * 1e3,
        bytes_moved=moved,
        gb_per_s=gb_per_s,
        copy_fraction=gb_per_s / copy_gb_per_s,
    )


def bench_plan(
    variants: tuple[BenchVariant, ...] = BENCH_VARIANTS,
    decode_rows: tuple[int, ...] = DECODE_ROWS,
    prefill_rows: tuple[int, ...] = PREFILL_ROWS,
) -> list[tuple[BenchVariant, str, int]]:
    """Every (variant, phase, rows) the benchmark times, in order."""
    sizes = [("decode", rows) for rows in decode_rows] + [("prefill", rows) for rows in prefill_rows]
    return [(variant, phase, rows) for variant in variants for phase, rows in sizes]


def run_kernel_bench(
    plan: list[tuple[BenchVariant, str, int]],
    dtype: torch.dtype = torch.bfloat16,
    on_step: Callable[[str], None] | None = None,
) -> KernelBenchResult:
    """Measure the copy bandwidth, then time each planned launch; ``on_step`` hears each finish."""
    device = cuda_device()
    copy_gb_per_s = copy_bandwidth(device)
    if on_step is not None:
        on_step("copy bandwidth")
    timings = []
    for variant, phase, rows in plan:
        timings.append(time_prep(variant, phase, rows, device, dtype, copy_gb_per_s))
        torch.cuda.empty_cache()
        if on_step is not None:
            on_step(f"{variant.label} {phase} {rows}")
    return KernelBenchResult(
        device=torch.cuda.get_device_name(device),
        dtype=str(dtype).removeprefix("torch."),
        copy_gb_per_s=copy_gb_per_s,
        timings=tuple(timings),
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
