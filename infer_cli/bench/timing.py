"""The one device timer every benchmark uses, and the ceilings floors are built from.

`device_ms` is the median of `triton.testing.do_bench`: CUDA events around each call after a
warm-up, with the L2 cache flushed before every call, so a call is timed as it runs in a step, not
on data a previous call left in cache. The ceilings are measured in the same run as what they
judge, never taken from a data sheet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

COPY_BYTES = 1 << 30
# The read-only stream is one GEMV over a weight far larger than L2 (50 MB), as a decode step reads
# its weights; K is Qwen3-4B's O projection's.
STREAM_BYTES = 2 << 30
STREAM_K = 4096
MATMUL_N = 8192


class BenchUnavailableError(RuntimeError):
    """The benchmark cannot run here (no CUDA device)."""


def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        raise BenchUnavailableError("this benchmark needs a CUDA device; torch.cuda.is_available() is False")
    return torch.device("cuda", torch.cuda.current_device())


def versions() -> dict[str, str]:
    """The torch and Triton a result was measured with."""
    import triton

    return {"torch": torch.__version__, "triton": str(triton.__version__)}


def device_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of one `fn()` on the current CUDA device (see the module doc)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_gb_per_s(device: torch.device, nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth in GB/s, counting both the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (device_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def stream_gb_per_s(device: torch.device, nbytes: int = STREAM_BYTES) -> float:
    """Read-only stream rate in GB/s: the bytes of a random bf16 weight [N, 4096] over the time of
    one cuBLAS GEMV against it (one row), the way a decode step streams its weights. A copy moves
    each byte twice (read and write); a read-only stream measured ~5 % faster per byte on the H200
    (shared/perf-notes.md, section 7), so decode floors are reported against both."""
    weight = torch.randn(nbytes // (2 * STREAM_K), STREAM_K, device=device, dtype=torch.bfloat16)
    row = torch.randn(1, STREAM_K, device=device, dtype=torch.bfloat16)
    ms = device_ms(lambda: torch.nn.functional.linear(row, weight))
    return weight.numel() * weight.element_size() / (ms * 1e-3) / 1e9


def matmul_tflops(device: torch.device, n: int = MATMUL_N) -> float:
    """bf16 n×n×n matmul rate in TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / (device_ms(lambda: a @ b) * 1e-3) / 1e12


def graph_us(calls: Sequence[Callable[[], object]]) -> float:
    """Median µs of one replay of a CUDA graph holding `calls` in order. They run once first on a
    side stream (compile, pick cuBLAS algorithms, allocate workspaces), outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    us = device_ms(graph.replay) * 1e3
    del graph
    return us
