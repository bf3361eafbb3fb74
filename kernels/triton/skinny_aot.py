"""Compile the skinny GEMM for sm_90 on a machine without a GPU, and check what the PTX holds.

The interpreter accepts programs the GPU compiler rejects, and it cannot show the two things the
kernel is built on: 16-byte weight loads and the PDL instructions. This compiles each launch
setting the benchmark tries (``kernels.gemm.skinny_candidates``) at the serving shapes, PDL on, down to
a cubin with the ptxas that ships with Triton, and checks the PTX for ``griddepcontrol.wait`` /
``griddepcontrol.launch_dependents`` and for 128-bit global loads. It specialises as the runtime
JIT does on those shapes: pointers and the integer arguments that are multiples of 16 are marked
divisible by 16 (M is never specialised). Run without ``TRITON_INTERPRET``:
``python -m kernels.triton.skinny_aot``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemm.skinny_candidates import candidate_settings
from kernels.triton.offline import compile_offline, run_compile_check
from kernels.triton.skinny_gemm import (
    REDUCE_BLOCK,
    SkinnySettings,
    _skinny_gemm_kernel,
    _split_k_reduce_kernel,
)
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES

# The projection shapes of Qwen3-4B and Gemma 4 12B (shared/presets.md), [N, K].
SERVING_SHAPES: tuple[tuple[int, int], ...] = (
    (6144, 2560),
    (2560, 4096),
    (19456, 2560),
    (2560, 9728),
    (151936, 2560),
    (8192, 3840),
    (8704, 3840),
    (3840, 4096),
    (3840, 8192),
    (30720, 3840),
    (3840, 15360),
    (262144, 3840),
)


@dataclass(frozen=True, slots=True)
class CompiledVariant:
    n: int
    k: int
    settings: SkinnySettings
    ptx: str
    has_cubin: bool

    @property
    def vector_loads(self) -> int:
        """16-byte global loads in the PTX: ``ld.global.v4.b32`` into registers (whole-slice mode)
        or ``cp.async ... 0x10`` into shared memory (K-loop mode's software pipeline)."""
        return sum(1 for line in self.ptx.splitlines() if _is_16_byte_load(line))

    @property
    def waits(self) -> bool:
        return "griddepcontrol.wait" in self.ptx and "griddepcontrol.launch_dependents" in self.ptx


def _is_16_byte_load(line: str) -> bool:
    if "ld.global" in line:
        return ".v4.b32" in line or ".v2.b64" in line
    return "cp.async" in line and ".global" in line and "0x10" in line


def _aligned(fn: triton.JITFunction, values: dict[str, int]) -> set[str]:
    """Every pointer, and each integer argument whose value at serving shapes is a multiple of 16."""
    pointers = {name for name in fn.arg_names if name.endswith("_ptr")}
    return pointers | {name for name, value in values.items() if value % 16 == 0}


def compile_gemm(
    n: int, k: int, settings: SkinnySettings, dtype: torch.dtype = torch.bfloat16, *, arch: int = 90
) -> CompiledVariant:
    """The GEMM kernel for an [n, k] weight under ``settings``, PDL on, compiled for ``sm_{arch}``."""
    part = settings.partition(k)
    split = part.split_k > 1
    split_k_n = part.split_k * n
    constexprs = {
        "BLOCK_M": settings.block_m,
        "BLOCK_N": settings.block_n,
        "BLOCK_K": part.block_k,
        "K_TILES": part.tiles_per_split,
        "WHOLE": settings.whole_slice,
        "STORAGE": tl.float32 if split else STORAGE_TYPES[dtype],
        "PDL": settings.pdl,
        "DOT_FP32": False,
        "IEEE": dtype == torch.float32,
    }
    out_type = "*fp32" if split else POINTER_TYPES[dtype]
    pointers = {"x_ptr": POINTER_TYPES[dtype], "w_ptr": POINTER_TYPES[dtype], "out_ptr": out_type}
    # x [1, K] contiguous: the runtime sees these values at M = 1.
    values = {
        "N": n,
        "K": k,
        "stride_xm": k,
        "stride_om": split_k_n if split else n,
        "stride_os": n if split else 0,
    }
    kernel = compile_offline(
        _skinny_gemm_kernel,
        constexprs,
        lambda name: pointers.get(name, "i32"),
        _aligned(_skinny_gemm_kernel, values),
        arch=arch,
        num_warps=settings.num_warps,
        num_stages=settings.num_stages,
        launch_pdl=settings.pdl,
        enable_fp_fusion=False,
    )
    return CompiledVariant(n, k, settings, kernel.asm["ptx"], bool(kernel.asm.get("cubin")))


def compile_reduce(n: int, split_k: int, dtype: torch.dtype = torch.bfloat16, *, arch: int = 90) -> str:
    """PTX of the split-K reduce kernel, PDL on."""
    constexprs = {"SPLIT_K": split_k, "BLOCK": REDUCE_BLOCK, "STORAGE": STORAGE_TYPES[dtype], "PDL": True}
    pointers = {"partial_ptr": "*fp32", "y_ptr": POINTER_TYPES[dtype]}
    kernel = compile_offline(
        _split_k_reduce_kernel,
        constexprs,
        lambda name: pointers.get(name, "i32"),
        _aligned(_split_k_reduce_kernel, {"N": n, "stride_ym": n}),
        arch=arch,
        num_warps=4,
        launch_pdl=True,
        enable_fp_fusion=False,
    )
    return str(kernel.asm["ptx"])


def main() -> int:
    failures = []
    for n, k in SERVING_SHAPES:
        for settings in candidate_settings(n, k):
            variant = compile_gemm(n, k, settings)
            problems = []
            if not variant.has_cubin:
                problems.append("no cubin")
            if settings.pdl and not variant.waits:
                problems.append("no griddepcontrol instructions")
            if variant.vector_loads == 0:
                problems.append("no 128-bit global loads")
            if problems:
                failures.append(f"[{n}, {k}] {settings.label}: {', '.join(problems)}")
            print(f"compiled [{n}, {k}] {settings.label}: {variant.vector_loads} vector loads")
            if settings.split_k > 1:
                ptx = compile_reduce(n, settings.split_k)
                if "griddepcontrol.wait" not in ptx:
                    failures.append(f"[{n}, {k}] reduce split_k={settings.split_k}: no griddepcontrol.wait")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    run_compile_check(main)
