"""The decode GEMV's launch settings swept per Qwen3-4B projection at one row, plain and fused (GPU).

Each (projection, fusion, rows per program, warps, K in one block or a head and tail) is timed as
`infer bench gemm` times a shape: a CUDA graph over enough distinct weight copies that nothing is
served from L2, median replay over the copies; cuBLAS (`F.linear`) beside it in the same run. The
fusions are the ones `--decode-fusion` launches (norm prologue on QKV and gate/up, SiLU·mul
epilogue on gate/up, residual epilogue on O and down), so the table says what each fusion costs at
each setting against the plain GEMV, and which setting a shape should ship with
(docs/benchmarks/gemm.md).

    python3 docs/benchmarks/scripts/gemv_sweep.py --save FILE.json [--rows 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from infer_cli.bench.gemm_timing import Projection, chain_copies, device_facts, gemm_bytes, qwen3_projections
from infer_cli.bench.timing import copy_gb_per_s, graph_us
from kernels.reference import GatedActivation
from kernels.triton.fused_gemv import (
    MAX_SLICE_ELEMENTS,
    QWEN3,
    Fusion,
    GemvSettings,
    fused_gemv,
    gemv_settings,
)

FUSED = {
    "qkv": Fusion(norm=QWEN3),
    "o": Fusion(residual=True),
    "gate-up": Fusion(norm=QWEN3, activation=GatedActivation.SILU),
    "down": Fusion(residual=True),
}
ROWS_PER_PROGRAM = (1, 2, 4)
WARPS = (4, 8)


def timed(
    projection: Projection, m: int, label: str, settings: GemvSettings | None, calls: list, floor_us: float
) -> dict[str, object] | None:
    """One row of the table (printed as it is taken), or None where the setting failed."""
    n, k = projection.shape
    setting = settings.label if settings else "-"
    try:
        us = graph_us(calls) / len(calls)
    except Exception as exc:  # a refused or failing setting is a row, not the end of the run
        print(f"{projection.name:8} {label:22} {setting:>20} FAILED {type(exc).__name__}: {exc}")
        return None
    print(f"{projection.name:8} {label:22} {setting:>20} {us:8.2f} us  {100 * floor_us / us:5.1f} %")
    return {
        "projection": projection.name,
        "n": n,
        "k": k,
        "rows": m,
        "variant": label,
        "settings": settings.label if settings else None,
        "us": us,
        "floor_us": floor_us,
        "pct_of_floor": 100 * floor_us / us,
    }


def sweep(
    projection: Projection, m: int, bandwidth: float, l2_bytes: int, device: torch.device
) -> list[dict[str, object]]:
    """cuBLAS, then every setting of the plain GEMV and of the projection's fused variant."""
    dtype = torch.bfloat16
    n, k = projection.shape
    weights = [
        torch.randn(n, k, dtype=dtype, device=device) * k**-0.5
        for _ in range(chain_copies(n * k * 2, l2_bytes))
    ]
    x = torch.randn(m, k, dtype=dtype, device=device)
    floor_us = gemm_bytes(n, k, m) / (bandwidth * 1e3)
    rows = [timed(projection, m, "cublas", None, [partial(F.linear, x, w) for w in weights], floor_us)]
    fusions = [("gemv", Fusion())]
    if projection.name in FUSED:
        fusions.append((FUSED[projection.name].name, FUSED[projection.name]))
    for label, fusion in fusions:
        gated = fusion.activation is not None
        n_out = n // 2 if gated else n
        norm_weight = 1 + 0.1 * torch.randn(k, dtype=dtype, device=device) if fusion.norm else None
        residual = torch.randn(m, n_out, dtype=dtype, device=device) if fusion.residual else None
        default = gemv_settings(n_out, k, gated=gated)
        tails = (False, True) if k & (k - 1) else (False,)  # a power-of-two K has no tail
        for per_program, warps, k_tail in itertools.product(ROWS_PER_PROGRAM, WARPS, tails):
            settings = GemvSettings(rows_per_program=per_program, num_warps=warps, k_tail=k_tail)
            if settings.slice_elements(k, gated=gated) > MAX_SLICE_ELEMENTS:
                continue
            call = partial(
                fused_gemv, fusion=fusion, settings=settings, norm_weight=norm_weight, residual=residual
            )
            tag = f"{label}{'*' if _loads_as(settings, default, k) else ''}"
            rows.append(timed(projection, m, tag, settings, [partial(call, x, w) for w in weights], floor_us))
    del weights
    torch.cuda.empty_cache()
    return [row for row in rows if row is not None]


def _loads_as(settings: GemvSettings, default: GemvSettings, k: int) -> bool:
    """Whether ``settings`` run as ``default`` does: K's blocks compared rather than the k_tail flag,
    which changes nothing at a power-of-two K."""
    alike_but_the_flag = settings == replace(default, k_tail=settings.k_tail)
    return alike_but_the_flag and settings.k_blocks(k) == default.k_blocks(k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=1, help="activation rows M (at most the GEMV's 4)")
    args = parser.parse_args()
    device = torch.device("cuda")
    name, l2_bytes = device_facts(device)
    bandwidth = copy_gb_per_s(device)
    results: list[dict[str, object]] = []
    for projection in qwen3_projections():  # saved after each projection: a cut-off run keeps what it took
        results += sweep(projection, args.rows, bandwidth, l2_bytes, device)
        summary = {"device": name, "copy_gb_per_s": bandwidth, "rows": args.rows, "results": results}
        args.save.write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.save} ({len(results)} timings; * marks the shipped default setting)")


if __name__ == "__main__":
    main()
