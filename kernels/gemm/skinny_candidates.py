"""The launch settings worth trying for one weight shape: what ``infer bench gemm`` measures.

Every rule here reads the weight shape [N, K] only, never the row count, so whichever candidate the
benchmark keeps for a shape serves every M with the same K partition (docs/kernels.md, "The skinny
GEMM"). The sizes come from the H200 probes in shared/perf-notes.md (2.1, 2.2, 7): about 8 K
weight elements (16 KB of bf16) in flight per program, enough programs for 132 SMs, and a fixed
split-K where N alone gives too few programs (the O and down projections, N = 2560-3840).
"""

from __future__ import annotations

from kernels.kv_layout import ceil_div
from kernels.triton.skinny_gemm import SkinnySettings

# Elements of weight one program requests at once (16 KB of bf16; perf-notes section 7, run 2).
SLICE_ELEMENTS = 8192
# Programs a launch should have so that every one of the H200's 132 SMs holds about four.
TARGET_PROGRAMS = 4 * 132


def _slice_width(k: int, widest: int) -> int:
    """The widest power-of-two K slice ≤ ``widest`` (and ≥ 128) that divides K, else ``widest``."""
    width = widest
    while width > 128 and k % width:
        width //= 2
    return width if k % width == 0 else widest


def whole_slice(k: int, *, pdl: bool = True) -> SkinnySettings:
    """Whole-slice mode: each program loads a [block_n, slice] tile of about ``SLICE_ELEMENTS`` at
    once, the slice a power of two ≤ 512 dividing K where one does; split_k = K / slice."""
    width = _slice_width(k, 512)
    return SkinnySettings(
        block_n=max(16, SLICE_ELEMENTS // width), block_k=None, split_k=ceil_div(k, width), pdl=pdl
    )


def k_loop(n: int, k: int, *, block_n: int = 16, block_k: int = 512, stages: int = 3) -> SkinnySettings:
    """K-loop mode, pipelined ``stages`` deep, split just enough for ``TARGET_PROGRAMS`` programs.

    Triton's software pipeline keeps ``stages - 1`` tiles per program in flight through shared
    memory (cp.async), without the registers a whole slice costs; the loads start after
    ``gdc_wait``, so PDL only lets the next kernel launch early. Fewer splits than whole-slice mode:
    fewer fp32 partials to write and add at larger M."""
    tiles = ceil_div(k, block_k)
    split = max(1, min(tiles, ceil_div(TARGET_PROGRAMS, ceil_div(n, block_n))))
    # No split may be empty: shrink until the last one starts inside K.
    while split > 1 and (split - 1) * ceil_div(tiles, split) >= tiles:
        split -= 1
    return SkinnySettings(block_n=block_n, block_k=block_k, split_k=split, num_stages=stages)


def candidate_settings(n: int, k: int) -> tuple[SkinnySettings, ...]:
    """Distinct settings that can run an [n, k] weight, the default first."""
    candidates = (
        whole_slice(k),
        whole_slice(k, pdl=False),
        k_loop(n, k),
        k_loop(n, k, block_n=32, block_k=256, stages=4),
    )
    unique: list[SkinnySettings] = []
    for settings in candidates:
        if settings not in unique and settings.problem(n, k) is None:
            unique.append(settings)
    return tuple(unique)


def default_settings(n: int, k: int) -> SkinnySettings:
    """The first candidate: whole-slice, PDL on. Used where no measurement chose one."""
    return candidate_settings(n, k)[0]
