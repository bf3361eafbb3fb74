"""Do other output tiles change the invariant GEMM's bits? (GPU; docs/benchmarks/invariance.md)

A launch may take other tiles and keep the promise only if an output element's bits do not depend
on the tile's rows and columns: the same K chunks, the same 64-column K tiles in the same order, the
same k16 tensor-core steps, only more or fewer of them side by side. Whether the hardware sums a
k16 step alike in a 64-row and a 128-row wgmma is not documented; on an H100 it did (7f84417), and
so did tiles of 16 and 32 rows, which Triton issues as mma.sync (9ccbfeb): `invariant` runs its
prefill in 128 × 256 tiles (a whole K) and 128 × 128 (a cut K) since. For each Qwen3-4B
projection, rows through the 64 × 64 tiles and through each candidate with the same K split (each
forced to the shipped tiles' `k_split`), compared bit for bit, and each timed at 8,192 rows and at
decode's 1, 8 and 64 rows (where the chunks meet across programs, the reduce launch included),
beside cuBLAS at each. Where K is cut, a program of many rows holds two fp32 tiles (its chunk's and
the running total): a 128 × 256 tile's two at 8 warps pass the 255 registers a thread has and
spill (ptxas, sm_90), a 128 × 128 tile's do not (169 registers), so both are timed, each at 3 and 4
stages. Tiles 128 columns deep along K (``k128``: one dot of eight k16 steps where the 64-deep tiles
take two of four) would halve the K loop's trips; whether they keep the bits is what they test (every
Qwen3-4B chunk is a whole number of 128-column tiles).

    python3 docs/benchmarks/scripts/invariant_tiles_probe.py --save FILE.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from infer_cli.bench.timing import device_ms
from kernels.gemm.dispatch import INVARIANT_TILES
from kernels.triton.invariant_gemm import GemmTiles, invariant_gemm

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
BASE = "64x64 w4"
CANDIDATES = {
    BASE: GemmTiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3),
    "16x64 w4": GemmTiles(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3),
    "32x64 w4": GemmTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3),
    "128x64 w4": GemmTiles(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3),
    "128x128 w8": GemmTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    "128x256 w8": GemmTiles(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    "128x128 w8 s4": GemmTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
    "128x256 w8 s4": GemmTiles(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4),
    "128x128 w8 k128": GemmTiles(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    "128x256 w8 k128 s2": GemmTiles(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=2),
}
ROWS = 8192
DECODE_ROWS = (1, 8, 64)


class _SameSplit(GemmTiles):
    """``tiles`` with the shipped tiles' K split for one weight shape, whatever its own would be."""


def with_split(tiles: GemmTiles, split: tuple[int, int]) -> GemmTiles:
    forced = _SameSplit(
        block_m=tiles.block_m,
        block_n=tiles.block_n,
        block_k=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        split_programs=INVARIANT_TILES.split_programs,
    )
    object.__setattr__(forced, "k_split", lambda n, k: split)
    return forced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    rows: list[dict[str, object]] = []
    for name, (n, k) in SHAPES.items():
        x = torch.randn(ROWS, k, device=device, generator=g, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16) / k**0.5
        split = INVARIANT_TILES.k_split(n, k)
        shipped = invariant_gemm(x, w, with_split(CANDIDATES[BASE], split))
        for label, tiles in CANDIDATES.items():
            forced = with_split(tiles, split)
            y = invariant_gemm(x, w, forced)
            differing = int((y.view(torch.int16) != shipped.view(torch.int16)).sum())
            ms = device_ms(partial(invariant_gemm, x, w, forced))
            tflops = 2 * ROWS * n * k / (ms * 1e-3) / 1e12
            decode_ms = {m: device_ms(partial(invariant_gemm, x[:m], w, forced)) for m in DECODE_ROWS}
            rows.append(
                {
                    "shape": name,
                    "n": n,
                    "k": k,
                    "split": list(split),
                    "tiles": label,
                    "ms": ms,
                    "tflops": tflops,
                    "decode_ms": decode_ms,
                    "differing_elements": differing,
                    "elements": ROWS * n,
                }
            )
            print(
                f"{name:8s} {label:18s} split {split}  {ms:7.3f} ms  {tflops:6.1f} TFLOP/s  "
                f"differing {differing} of {ROWS * n}  "
                + "  ".join(f"{m} rows {decode_ms[m] * 1e3:5.1f} µs" for m in DECODE_ROWS)
            )
    cublas: dict[str, dict[int, float]] = {}
    for name, (n, k) in SHAPES.items():
        x = torch.randn(ROWS, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        cublas[name] = {
            m: device_ms(partial(torch.nn.functional.linear, x[:m], w)) for m in (ROWS, *DECODE_ROWS)
        }
        print(
            f"{name:8s} cuBLAS             {cublas[name][ROWS]:7.3f} ms  "
            + "  ".join(f"{m} rows {cublas[name][m] * 1e3:5.1f} µs" for m in DECODE_ROWS)
        )
    args.save.write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "cublas_ms": cublas}, indent=1)
    )


if __name__ == "__main__":
    main()
