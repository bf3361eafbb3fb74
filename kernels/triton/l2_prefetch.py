"""Warm the L2 cache with a weight the step reads soon, while latency-bound kernels leave HBM idle
(docs/kernels.md, "L2 prefetch").

At small batch a decode layer alternates weight streams (the projections, bandwidth-bound) with
short kernels that barely touch memory: attention prep, attention and its merge take ~9 µs a layer
at batch 1 on an H100, and FlashInfer's kernels let their dependents launch only at their end, so
the O projection after them starts its weight stream cold. ``prefetch_to_l2(weight)`` launched
between the prep kernel and attention asks the memory system for the weight's bytes
(``cp.async.bulk.prefetch.L2``: no registers, no completion to wait for) so they stream during
attention and the projection reads them from L2.

Nothing it does is visible in any value: it reads and writes no tensor, so every numeric policy's
bits stay as they are. PDL on sm_90+: it lets the next kernel launch at once, waits for the kernel
before it (so "the previous kernel has completed" stays transitive along the chain, and the
prefetch does not compete with the projection before the prep kernel), then issues its requests.

Each program takes ``PIECES`` consecutive pieces of ``piece`` bytes (a multiple of 16, as the
instruction needs), one per thread; the last may be short and those past the end issue nothing.
``python -m kernels.triton.l2_prefetch`` compiles it for sm_90 without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import compile_offline, ptx_of, require_pdl_build, run_compile_check
from kernels.triton.storage import multiprocessors, pdl_supported

# The instruction's operand rules (PTX ISA, cp.async.bulk.prefetch): a 16-byte aligned global
# address and a size that is a multiple of 16.
ALIGN = 16
PREFETCH_INSTRUCTION = "cp.async.bulk.prefetch.L2.global"


class L2PrefetchError(ValueError):
    """A tensor the prefetch cannot take; the message names its shape, layout or device."""


@dataclass(frozen=True, slots=True)
class PrefetchLayout:
    """How a prefetch spreads over the GPU: ``programs_per_sm`` programs of ``pieces`` threads each
    (one warp per 32), each thread one piece."""

    programs_per_sm: int = 1
    pieces: int = 128

    def pieces_of(self, nbytes: int, sms: int) -> tuple[int, int]:
        """(programs, piece bytes) covering ``nbytes`` (a multiple of ALIGN)."""
        programs = max(1, self.programs_per_sm * sms)
        piece = ceil_div(ceil_div(nbytes, programs * self.pieces), ALIGN) * ALIGN
        return min(programs, ceil_div(nbytes, piece * self.pieces)), piece


DEFAULT_LAYOUT = PrefetchLayout()


@triton.jit
def _l2_prefetch_kernel(base_ptr, nbytes, piece, PIECES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # attention may launch now and wait for us
        tl.extra.cuda.gdc_wait()  # the prefetch follows the projection's stream, never competes with it
    start = (tl.program_id(0).to(tl.int64) * PIECES + tl.arange(0, PIECES)) * piece
    size = tl.minimum(nbytes - start, piece).to(tl.int32)  # ≤ 0 past the end: nothing issued
    tl.inline_asm_elementwise(
        "{ .reg .pred live; setp.gt.s32 live, $2, 0; @live cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [base_ptr + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


_l2_prefetch_launch = FastLaunch(_l2_prefetch_kernel)


def runs_on(device: torch.device) -> bool:
    """Whether a prefetch on ``device`` issues anything: sm_90+ (the bulk prefetch), not interpreted."""
    return pdl_supported(device)


def prefetch_to_l2(weight: torch.Tensor, layout: PrefetchLayout = DEFAULT_LAYOUT) -> None:
    """Ask for ``weight``'s bytes in L2 (one launch, graph-safe); a no-op where ``runs_on`` is false.
    The tensor must be contiguous and 16-byte aligned (raises ``L2PrefetchError`` naming it, on every
    device); its bytes are taken up to the last multiple of ALIGN."""
    if not weight.is_contiguous():
        raise L2PrefetchError(f"weight {tuple(weight.shape)} strides {weight.stride()}: must be contiguous")
    if weight.data_ptr() % ALIGN:
        raise L2PrefetchError(
            f"weight {tuple(weight.shape)} at {weight.data_ptr():#x}: not {ALIGN}-byte aligned"
        )
    nbytes = weight.numel() * weight.element_size() // ALIGN * ALIGN
    if nbytes == 0 or not runs_on(weight.device):
        return
    programs, piece = layout.pieces_of(nbytes, multiprocessors(weight.device))
    _l2_prefetch_launch[(programs,)](
        weight.reshape(-1).view(torch.uint8),
        nbytes,
        piece,
        PIECES=layout.pieces,
        PDL=True,
        num_warps=max(1, layout.pieces // 32),
        launch_pdl=True,
    )


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)


def compile_variant(layout: PrefetchLayout = DEFAULT_LAYOUT, arch: int = 90) -> object:
    """The compiled kernel for ``sm_{arch}`` without a GPU, as it launches there."""
    return compile_offline(
        _l2_prefetch_kernel,
        {"PIECES": layout.pieces, "PDL": True},
        lambda name: "*u8" if name.endswith("_ptr") else "i32",
        ("base_ptr",),
        arch=arch,
        num_warps=max(1, layout.pieces // 32),
        launch_pdl=True,
    )


def main() -> int:
    kernel = compile_variant()
    require_pdl_build(kernel, "l2 prefetch")
    if PREFETCH_INSTRUCTION not in ptx_of(kernel):
        raise RuntimeError(f"no {PREFETCH_INSTRUCTION} in the l2 prefetch build")
    print(f"compiled l2 prefetch pieces={DEFAULT_LAYOUT.pieces}")
    return 0


if __name__ == "__main__":
    run_compile_check(main)
