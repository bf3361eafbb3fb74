"""Warm the L2 cache with a weight the step reads next, while HBM would otherwise idle
(docs/kernels.md, "L2 prefetch of the output projection").

At small decode batches attention reads little (a 512-token Qwen3-4B row holds 2 MB of KV a layer)
yet takes ~9 µs of every layer at batch 1 on an H100 (FlashInfer's attention and its merge,
docs/benchmarks/qwen3.md), and the O projection after it cannot stream its 21 MB weight early:
FlashInfer's merge lets its dependent launch only at its end. Issued between the prep kernel and
attention, this kernel asks the memory system to pull the O weight into L2 during that window, so
the projection reads L2 instead of HBM.

One program per ``CHUNKS_PER_PROGRAM`` chunks of ``CHUNK_BYTES``, one warp, one chunk per thread:
each thread issues one ``cp.async.bulk.prefetch.L2.global`` (sm_90+; a hint that writes nothing and
that the hardware may drop) and the program ends. PDL as every kernel of the chain
(kernels/triton/storage.py): ``gdc_launch_dependents()`` first, then ``gdc_wait()``, then the
prefetches. Waiting first costs nothing the chain would not pay (the attention after it waits for the
kernel before anyway) and keeps the requests off HBM while the QKV projection still streams; a
prefetch has no completion to wait for, so the program ends as soon as its request is issued. No arithmetic anywhere: a prefetch cannot change a result.

CUDA-graph safe (the grid depends on the weight's size only). On anything but CUDA sm_90+ with PDL,
and under the interpreter, ``prefetch_to_l2`` launches nothing.
``python -m kernels.triton.l2_prefetch`` compiles the kernel for sm_90 without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import compile_offline, has_cubin, has_pdl_instructions, run_compile_check
from kernels.triton.storage import pdl_supported

# Steps of at most this many token rows prefetch: decode batches, where attention leaves HBM idle.
# A prefill's attention is compute-bound and its projections are matmuls that reuse each weight tile.
MAX_ROWS = 64
# Bytes one thread asks for: 21 MB of O weight is 5,120 requests over 160 one-warp programs, so
# the requests leave from more SMs than the GPU has (132 on the H100).
CHUNK_BYTES = 4096
CHUNKS_PER_PROGRAM = 32
# cp.async.bulk needs a 16-byte aligned source and a size that is a multiple of 16.
BULK_ALIGN = 16
# What the compile check looks for in the PTX (the kernel's asm spells it out: a jit function reads
# no module string).
PREFETCH_INSTRUCTION = "cp.async.bulk.prefetch.L2.global"


@triton.jit
def _l2_prefetch_kernel(base_ptr, n_bytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    tl.extra.cuda.gdc_launch_dependents()
    # After the wait: requests issued earlier would compete with the projection still streaming
    # before us; from here on HBM would idle through attention.
    tl.extra.cuda.gdc_wait()
    start = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    size = tl.minimum(n_bytes - start, CHUNK).to(tl.int32)  # ≤ 0 past the end: no request
    tl.inline_asm_elementwise(
        "{ .reg .pred live; setp.gt.s32 live, $2, 0; @live cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [base_ptr + start, size],
        dtype=tl.int32,
        is_pure=False,  # its only effect is on the memory system: kept though nothing reads it
        pack=1,
    )


_l2_prefetch_launch = FastLaunch(_l2_prefetch_kernel)


def max_rows() -> int:
    """``MAX_ROWS``, or ``INFER_L2_PREFETCH_ROWS`` where set (0: never prefetch; for measuring what
    the prefetch buys, as ``INFER_PDL=0`` does for PDL)."""
    value = os.environ.get("INFER_L2_PREFETCH_ROWS", "")
    return int(value) if value.strip() else MAX_ROWS


def prefetch_supported(weight: torch.Tensor) -> bool:
    """Whether ``prefetch_to_l2`` launches for ``weight``: CUDA sm_90+ with PDL (the kernel waits
    like every kernel of the chain), a contiguous weight whose first byte is 16-byte aligned."""
    return pdl_supported(weight.device) and weight.is_contiguous() and weight.data_ptr() % BULK_ALIGN == 0


def prefetch_to_l2(weight: torch.Tensor) -> None:
    """Ask for ``weight``'s bytes in L2 (whole 16-byte multiples; the hardware may drop any of it)."""
    if not prefetch_supported(weight):
        return
    n_bytes = weight.numel() * weight.element_size() // BULK_ALIGN * BULK_ALIGN
    if n_bytes == 0:
        return
    grid = (ceil_div(ceil_div(n_bytes, CHUNK_BYTES), CHUNKS_PER_PROGRAM),)
    _l2_prefetch_launch[grid](
        weight.view(-1).view(torch.uint8),
        n_bytes,
        CHUNK=CHUNK_BYTES,
        PER_PROGRAM=CHUNKS_PER_PROGRAM,
        num_warps=1,
        launch_pdl=True,
    )


def compile_variant(arch: int = 90) -> object:
    """The kernel compiled for ``sm_{arch}`` without a GPU, as it launches there."""
    return compile_offline(
        _l2_prefetch_kernel,
        {"CHUNK": CHUNK_BYTES, "PER_PROGRAM": CHUNKS_PER_PROGRAM},
        lambda name: "*u8" if name.endswith("_ptr") else "i64",
        {"base_ptr"},
        arch=arch,
        num_warps=1,
        launch_pdl=True,
    )


def main() -> int:
    kernel = compile_variant()
    ptx = str(kernel.asm.get("ptx", ""))  # type: ignore[attr-defined]
    if not has_cubin(kernel) or PREFETCH_INSTRUCTION not in ptx or not has_pdl_instructions(ptx):
        print("the L2 prefetch kernel lacks its cubin, its prefetch or its PDL instructions")
        return 1
    print("compiled l2_prefetch for sm_90")
    return 0


if __name__ == "__main__":
    run_compile_check(main)
