"""What one eager launch costs the host, for the calls a Qwen3-4B prefill makes once per layer.

    python3 docs/benchmarks/scripts/host_launch_costs.py [--rows 1024] [--save FILE.json]

A 1k-token prefill is host-bound (docs/benchmarks/qwen3.md: 27-32 ms a step against 14.4 ms of
kernels), and cProfile, which adds its own cost to every Python call, cannot say how much of it a C
call such as ``F.linear`` takes by itself. Here the device first runs a long spin kernel, so every
call below only enqueues: the host time of N calls over N is the call's own cost. Each figure is the
median of 7 rounds of 200 calls. The calls:

* ``F.linear`` at each projection shape of the layer, under each of torch's BLAS backends
  (``torch.backends.cuda.preferred_blas_library``), with each backend's device time per GEMM
  (CUDA events, nothing else queued) beside it: a backend that is cheaper on the host must not
  be slower on the device;
* ``torch.empty`` of the gate/up output;
* the Triton RMSNorm three ways: through ``invariant_rms_norm`` (argument checks and FastLaunch,
  kernels/triton/launch.py), through Triton's own dispatch (``kernel[grid](...)``), and through its
  compiled kernel's launcher alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.reference import NormSpec, NormWeight
from kernels.triton.invariant_rmsnorm import _MODES, _invariant_rmsnorm_kernel, invariant_rms_norm
from kernels.triton.storage import STORAGE_TYPES

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2560, 32, 8, 128, 9728  # Qwen3-4B (presets.md)
SHAPES = {  # projection: (N, K)
    "qkv": ((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, Q_HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}
CALLS, ROUNDS = 200, 7


def host_us(call: Callable[[], object]) -> float:
    """Median host µs of one ``call`` while the device is held by a spin kernel (only enqueues)."""
    call()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(ROUNDS):
        torch.cuda._sleep(200_000_000)  # ~0.1 s at the H200's clocks: longer than the calls below
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        rounds.append((time.perf_counter() - start) * 1e6 / CALLS)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def device_us(call: Callable[[], object]) -> float:
    for _ in range(3):
        call()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(20):
        call()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    dev, dtype, m = torch.device("cuda"), torch.bfloat16, args.rows
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "rows": m, "calls": CALLS}

    blas: dict[str, dict[str, dict[str, float]]] = {}
    for backend in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(backend)
        blas[backend] = {}
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device=dev, dtype=dtype)
            w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
            linear = functools.partial(F.linear, x, w)
            blas[backend][name] = {"host_us": host_us(linear), "device_us": device_us(linear)}
            print(f"F.linear {backend:8s} {name:8s} M={m}: {blas[backend][name]}")
    torch.backends.cuda.preferred_blas_library("default")
    report["linear"] = blas
    report["empty_us"] = host_us(lambda: torch.empty(m, 2 * INTERMEDIATE, device=dev, dtype=dtype))

    x = torch.randn(m, HIDDEN, device=dev, dtype=dtype)
    weight = torch.randn(HIDDEN, device=dev, dtype=dtype)
    spec = NormSpec(NormWeight.W)
    report["rmsnorm_us"] = host_us(lambda: invariant_rms_norm(x, spec, weight))
    y = torch.empty_like(x)
    positional = (
        x,
        x,
        x,
        x,
        weight,
        y,
        y,
        HIDDEN,
        x.stride(0),
        x.stride(0),
        y.stride(0),
        y.stride(0),
        spec.eps,
    )
    constexprs = dict(
        BLOCK_H=4096,
        WEIGHT_MODE=_MODES[spec.weight],
        ROUND_BEFORE_WEIGHT=False,
        STORAGE=STORAGE_TYPES[dtype],
        HAS_DELTA=False,
        DELTA_NORM=False,
        HAS_SCALE=False,
        PDL=False,
        num_warps=4,
        enable_fp_fusion=False,
    )
    report["rmsnorm_dispatch_us"] = host_us(
        lambda: _invariant_rmsnorm_kernel[(m,)](*positional, **constexprs)
    )
    # The compiled kernel the dispatch found, launched by its own launcher with the arguments the
    # dispatch bound (constexprs included: the launcher takes every parameter and skips those).
    # Triton's internals (its per-device caches, the launcher's calling convention) differ between
    # releases: where they do, the report says so instead of a figure.
    try:
        caches = _invariant_rmsnorm_kernel.device_caches[torch.cuda.current_device()]
        compiled = next(iter(caches[0].values()))
        bound, _, _ = caches[4](*positional, **constexprs)
        launch_args = tuple(bound.values())
        stream = torch.cuda.current_stream().cuda_stream

        def direct() -> None:
            compiled.run(
                m, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *launch_args
            )

        report["rmsnorm_launcher_us"] = host_us(direct)
    except Exception as exc:
        report["rmsnorm_launcher_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({k: v for k, v in report.items() if k != "linear"}, indent=1))
    if args.save:
        args.save.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
