"""Where one engine step's time goes: `infer bench latency --breakdown`.

A few steps run under torch.profiler. On a GPU the device's kernels (CUPTI reports those replayed
from a CUDA graph one by one) are grouped by name into categories; the time the device was busy is
the union of their intervals, so kernels overlapping on two streams count once. Set beside the
step's host time (measured without the profiler, which slows the host), the difference is the host
gap: time the device spent waiting for the host (scheduling, plans, sampling's copies back).
Without a GPU the same figures come from operators' own CPU time, which is what the tests use.

Kernel names are matched in lower case, first category first; a name no pattern matches is
`other`, and the heaviest names are kept so an `other` that matters can be read and placed.

On a GPU the host's calls into CUDA (runtime `cuda*` and driver `cu*` calls, as the profiler
records them) are summed by name too: a launch costs the host microseconds, so a call whose time
per step is large is where the host waited for the device (a synchronising copy, an event or
stream wait), and the total says how much of the step the host spent in CUDA at all.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        # The Triton kernel that normalises q/k, applies RoPE and writes the KV pages.
        ("prep", r"attention_prep"),
        ("attention", r"flashinfer|batchprefill|batchdecode|merge_state|attention|sdpa|flash_"),
        ("gemm", r"gemm|gemv|cublas|cutlass|nvjet|xmma|matmul|aten::mm\b|aten::addmm|aten::bmm"),
        ("norm", r"rmsnorm|rms_norm|layer_norm"),
        # The Triton token draw (kernels/triton/token_draw.py) and torch's sampling ops.
        ("sampling", r"token_draw|softmax|argmax|topk|sort|multinomial|cumsum|exponential"),
        ("copy", r"copy|memcpy|memset|fill|index|gather|scatter|aten::cat"),
        (
            "elementwise",
            r"elementwise|vectorized|unrolled|reduce|silu|gelu|tanh|add|mul|pow|rsqrt|mean|aten::",
        ),
    )
)
OTHER = "other"
TOP_KERNELS = 8
TOP_HOST_CALLS = 6
TIMELINE_NAME_CHARS = 96
# What the profiler names a host call into CUDA: the runtime's `cudaLaunchKernel`, the driver's
# `cuLaunchKernelEx` (Triton's launcher), `cudaStreamSynchronize`, ...
_CUDA_CALL = re.compile(r"^cu(da)?[A-Z]")


def category_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((category for category, pattern in CATEGORIES if pattern.search(name)), OTHER)


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel (or, without a GPU, one operator's own time) as the profiler saw it, in µs."""

    name: str
    start_us: float
    duration_us: float


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    """Device time of one step, averaged over the profiled steps, in ms."""

    steps: int
    host_ms: float
    busy_ms: float
    kernels_per_step: float
    by_category: tuple[tuple[str, float], ...]
    top: tuple[tuple[str, float], ...]  # the heaviest kernel names, ms per step
    # The host's calls into CUDA by name, the heaviest first: (name, calls per step, ms per step).
    host_calls: tuple[tuple[str, float, float], ...] = ()
    # The last profiled step's kernels in start order: (name, start µs after the step's first
    # kernel, duration µs). Where a step's time goes between kernels (gaps, PDL overlap) shows here
    # and nowhere in the sums above.
    timeline: tuple[tuple[str, float, float], ...] = ()

    @property
    def host_gap_ms(self) -> float:
        return max(0.0, self.host_ms - self.busy_ms)

    def category_ms(self, category: str) -> float:
        return dict(self.by_category).get(category, 0.0)

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any]) -> StepBreakdown:
        """The breakdown as `infer bench latency --save-result` wrote it (`asdict`, plus the gap).
        A missing field raises KeyError, a malformed one TypeError or ValueError."""
        return cls(
            steps=int(saved["steps"]),
            host_ms=float(saved["host_ms"]),
            busy_ms=float(saved["busy_ms"]),
            kernels_per_step=float(saved["kernels_per_step"]),
            by_category=tuple((str(name), float(ms)) for name, ms in saved["by_category"]),
            top=tuple((str(name), float(ms)) for name, ms in saved["top"]),
            host_calls=tuple(
                (str(name), float(calls), float(ms)) for name, calls, ms in saved.get("host_calls", ())
            ),
            timeline=tuple(
                (str(name), float(start), float(us)) for name, start, us in saved.get("timeline", ())
            ),
        )


def union_us(kernels: Iterable[Kernel]) -> float:
    """Time covered by at least one of the kernels' intervals."""
    covered, reach = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        end = k.start_us + k.duration_us
        if end > reach:
            covered += end - max(k.start_us, reach)
            reach = end
    return covered


def summarize(
    kernels: list[Kernel],
    busy_us: float,
    steps: int,
    host_ms: float,
    host_calls: Iterable[Kernel] = (),
) -> StepBreakdown:
    """The breakdown of `steps` profiled steps' kernels, which kept the device busy for `busy_us`
    in all; `host_ms` is one step's unprofiled time; `host_calls` the host's calls into CUDA."""
    per_category: dict[str, float] = defaultdict(float)
    per_name: dict[str, float] = defaultdict(float)
    for k in kernels:
        per_category[category_of(k.name)] += k.duration_us
        per_name[k.name] += k.duration_us
    order = [category for category, _ in CATEGORIES] + [OTHER]
    heaviest = sorted(per_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    call_count: dict[str, int] = defaultdict(int)
    call_us: dict[str, float] = defaultdict(float)
    for call in host_calls:
        call_count[call.name] += 1
        call_us[call.name] += call.duration_us
    slowest_calls = sorted(call_us.items(), key=lambda item: -item[1])[:TOP_HOST_CALLS]
    return StepBreakdown(
        steps=steps,
        host_ms=host_ms,
        busy_ms=busy_us / steps / 1e3,
        kernels_per_step=len(kernels) / steps,
        by_category=tuple((c, per_category[c] / steps / 1e3) for c in order),
        top=tuple((name, us / steps / 1e3) for name, us in heaviest),
        host_calls=tuple((name, call_count[name] / steps, us / steps / 1e3) for name, us in slowest_calls),
        timeline=last_step_timeline(kernels, steps),
    )


@dataclass(frozen=True, slots=True)
class KernelShare:
    """What the kernels of one name did in a timeline, µs: how often they ran, their summed
    duration, ``advance`` (how far each moved the last completion so far on: the advances of all
    names sum to the union of the kernels' intervals, an overlap under PDL counted once) and
    ``idle_before`` (device time idle just before each started: a boundary nothing overlapped)."""

    name: str
    count: int
    duration_us: float
    advance_us: float
    idle_before_us: float


def timeline_shares(timeline: Iterable[tuple[str, float, float]]) -> list[KernelShare]:
    """The timeline's kernels by name (a template's arguments cut at its first ``<``), largest
    advance first."""
    count: dict[str, int] = defaultdict(int)
    duration: dict[str, float] = defaultdict(float)
    advance: dict[str, float] = defaultdict(float)
    idle: dict[str, float] = defaultdict(float)
    ordered = sorted(timeline, key=lambda k: k[1])
    reach = ordered[0][1] if ordered else 0.0  # the last completion so far
    for name, start, us in ordered:
        short, end = name.split("<", 1)[0], start + us
        count[short] += 1
        duration[short] += us
        idle[short] += max(0.0, start - reach)
        advance[short] += max(0.0, end - max(reach, start))
        reach = max(reach, end)
    shares = [KernelShare(n, count[n], duration[n], advance[n], idle[n]) for n in count]
    return sorted(shares, key=lambda s: -s.advance_us)


def last_step_timeline(kernels: Iterable[Kernel], steps: int) -> tuple[tuple[str, float, float], ...]:
    """The last of `steps` equal steps' kernels in start order, timed from its first kernel; names
    cut to ``TIMELINE_NAME_CHARS`` (FlashInfer's template names run to hundreds)."""
    ordered = sorted(kernels, key=lambda k: k.start_us)
    last = ordered[len(ordered) - round(len(ordered) / max(steps, 1)) :]
    if not last:
        return ()
    origin = last[0].start_us
    return tuple((k.name[:TIMELINE_NAME_CHARS], k.start_us - origin, k.duration_us) for k in last)


def profiled_kernels(
    step: Callable[[], object], steps: int, device: torch.device
) -> tuple[list[Kernel], float, list[Kernel]]:
    """Run `step` `steps` times under the profiler: the device's kernels, the time they kept it
    busy (the union of their intervals), and the host's calls into CUDA. On the CPU: operators' own
    time, one thread, so busy is their sum, and no CUDA calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize(device)
    kernels, calls = [], []
    for event in prof.events():
        if on_gpu and event.device_type == DeviceType.CPU and _CUDA_CALL.match(event.name):
            calls.append(Kernel(event.name, float(event.time_range.start), event.time_range.elapsed_us()))
            continue
        if on_gpu and event.device_type == DeviceType.CUDA:
            duration = event.time_range.elapsed_us()
        elif not on_gpu and event.device_type == DeviceType.CPU:
            duration = event.self_cpu_time_total
        else:
            continue
        if duration > 0:
            kernels.append(Kernel(event.name, float(event.time_range.start), float(duration)))
    busy = union_us(kernels) if on_gpu else sum(k.duration_us for k in kernels)
    return kernels, busy, calls


def profile_steps(
    step: Callable[[], object], device: torch.device, host_ms: float, steps: int = 3
) -> StepBreakdown:
    kernels, busy_us, calls = profiled_kernels(step, steps, device)
    return summarize(kernels, busy_us, steps, host_ms, calls)
