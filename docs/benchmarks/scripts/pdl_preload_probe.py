"""How much of a decode GEMV's weight stream its PDL predecessor's time hides, per projection and
GEMV layout: the question the 2026-12-07 H100 timelines left (docs/benchmarks/qwen3.md). There the
QKV projection ends ~10 µs after the norm before it (its preloaded slices save ~4 µs against the
projection alone), while the O projection ends 9.0-9.7 µs after the attention before it, as long as
it takes alone, although it launched ~10 µs earlier.

    python3 docs/benchmarks/scripts/pdl_preload_probe.py [--holds 0,3,6,10,20] [--save FILE]

A hold kernel stands in for the predecessor: one 1-warp program per SM that waits for the kernel
before it (PDL), lets the next one launch at once, and spins `hold` µs on %globaltimer. Each case is
a CUDA graph of `PAIRS` (hold, GEMV) pairs over rotating weight copies (more bytes than L2 holds, so
no pair reads weights a previous one left in cache), timed by `infer_cli.bench.timing.graph_us`; the
same graph of holds alone is timed in the same process. `after_us` = (pairs − holds alone) / PAIRS: what the projection adds past the end of
its predecessor. With no preload it stays at the projection's own time whatever the hold; with
preload it falls as the hold grows, down to the time the slices that did not fit in flight take.
Needs CUDA, a Triton with PDL (sm_90+) and this repository on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from infer_cli.bench.timing import copy_gb_per_s, cuda_device, graph_us, versions
from kernels.triton.fused_gemv import MAX_SLICE_ELEMENTS, GemvSettings, fused_gemv, gemv_settings
from kernels.triton.storage import multiprocessors, pdl_supported

# Qwen3-4B's decode projections [N, K] (shared/presets.md).
SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate-up": (19456, 2560), "down": (2560, 9728)}
PAIRS = 64
L2_MARGIN_BYTES = 200 << 20  # weight copies per case: at least this many bytes, 4× the H100's L2


@triton.jit
def _hold_kernel(ns):
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    start = tl.extra.cuda.globaltimer()
    now = start
    while now - start < ns:
        now = tl.extra.cuda.globaltimer()


def _hold(ns: int, programs: int) -> None:
    _hold_kernel[(programs,)](ns, num_warps=1, launch_pdl=True)


def layouts(n: int, k: int) -> dict[str, GemvSettings]:
    """The shipped layout, one and twice its rows per program, and twice its warps."""
    shipped = gemv_settings(n, k)
    variants = {
        "shipped": shipped,
        "rows1": replace(shipped, rows_per_program=1),
        "rows x2": replace(shipped, rows_per_program=shipped.rows_per_program * 2),
        "warps x2": replace(shipped, num_warps=shipped.num_warps * 2),
    }
    unique: dict[str, GemvSettings] = {}
    for label, settings in variants.items():
        if settings.slice_elements(k) <= MAX_SLICE_ELEMENTS and settings not in unique.values():
            unique[label] = settings
    return unique


def after_us(
    row: torch.Tensor,
    weights: list[torch.Tensor],
    out: torch.Tensor,
    settings: GemvSettings,
    hold_ns: int,
    programs: int,
) -> float:
    """µs one GEMV adds past the end of a `hold_ns` predecessor (module doc)."""
    hold = partial(_hold, hold_ns, programs)
    holds_alone = [hold] * PAIRS
    pairs = [
        call
        for i in range(PAIRS)
        for call in (hold, partial(fused_gemv, row, weights[i % len(weights)], settings=settings, out=out))
    ]
    return (graph_us(pairs) - graph_us(holds_alone)) / PAIRS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--holds", default="0,3,6,10,20", help="predecessor µs, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    device = cuda_device()
    if not pdl_supported(device):
        raise SystemExit("PDL is not supported here (needs sm_90+ and a Triton with the gdc ops)")
    programs = multiprocessors(device)
    copy = copy_gb_per_s(device)
    holds = [int(h) for h in args.holds.split(",")]
    rows = []
    x = torch.randn(1, 16384, device=device, dtype=torch.bfloat16)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, -(-L2_MARGIN_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
        floor_us = n * k * 2 / (copy * 1e9) * 1e6
        for label, settings in layouts(n, k).items():
            for hold_us in holds:
                added = after_us(x[:, :k], weights, out, settings, hold_us * 1000, programs)
                rows.append(
                    {
                        "shape": name,
                        "n": n,
                        "k": k,
                        "layout": label,
                        "settings": settings.label,
                        "hold_us": hold_us,
                        "after_us": added,
                        "floor_us": floor_us,
                    }
                )
                print(
                    f"{name:8} {label:12} hold {hold_us:3} µs: +{added:6.2f} µs after it (floor {floor_us:5.2f})"
                )
    if args.save:
        meta = {"device": torch.cuda.get_device_name(device), "copy_gb_per_s": copy, **versions()}
        args.save.write_text(json.dumps({**meta, "pairs": PAIRS, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
