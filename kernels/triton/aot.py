"""Compile the prep kernel for a GPU target on a machine without one.

Triton's GPU frontend is stricter than its interpreter (e.g. names bound in both branches of a
runtime ``if`` must agree in shape), so the interpreter tests alone do not prove the kernel builds.
This compiles every variant at serving head counts down to a cubin, which needs only the ptxas
that ships with Triton. It must run without ``TRITON_INTERPRET`` (the jit functions would be
interpreter objects): ``python -m kernels.triton.aot``.
"""

from __future__ import annotations

import sys

import torch

from kernels.reference import (
    PrepSpec,
    gemma3_prep,
    gemma4_global_prep,
    gemma4_sliding_prep,
    qwen3_prep,
    qwen35_full_attention_prep,
)
from kernels.triton.attention_prep import DEFAULT_LAUNCH, PrepLaunchConfig, prep_constexprs
from kernels.triton.offline import (
    compile_offline,
    has_pdl_instructions,
    pointers_and_strides,
    ptx_of,
    run_compile_check,
)
from kernels.triton.prep_kernel import attention_prep_kernel
from kernels.triton.storage import POINTER_TYPES

_INDEX_POINTERS = ("positions_ptr", "seq_index_ptr", "page_table_ptr")

# (spec, q heads, kv heads): the serving shapes in shared/presets.md.
SERVING_VARIANTS: tuple[tuple[PrepSpec, int, int], ...] = (
    (qwen3_prep(), 32, 8),
    (qwen35_full_attention_prep(), 16, 4),
    (gemma4_sliding_prep(), 16, 8),
    (gemma4_global_prep(), 16, 1),
    (gemma4_global_prep(), 32, 4),
    (gemma3_prep(), 4, 1),
)


def compile_variant(
    spec: PrepSpec,
    q_heads: int,
    kv_heads: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    arch: int = 90,
    launch: PrepLaunchConfig = DEFAULT_LAUNCH,
    pdl: bool = True,
) -> object:
    """The compiled kernel (cubin included) for one variant on ``sm_{arch}``, PDL on as a GPU of
    that arch launches it (or off)."""

    def arg_type(name: str) -> str:
        if name in _INDEX_POINTERS:
            return "*i32"
        if name.endswith("_ptr"):
            return POINTER_TYPES[dtype]
        return "fp32" if name.endswith("_eps") else "i64"

    # What the runtime JIT infers at serving shapes: 16-byte aligned buffers and strides that are
    # multiples of 16 elements (head dims and widths are). Without it loads would not vectorise.
    aligned = pointers_and_strides(attention_prep_kernel) - {"stride_page_table_row"}
    return compile_offline(
        attention_prep_kernel,
        prep_constexprs(spec, q_heads, kv_heads, dtype, launch, pdl=pdl),
        arg_type,
        aligned,
        arch=arch,
        num_warps=launch.num_warps,
        enable_fp_fusion=False,
        launch_pdl=pdl,
    )


def main() -> int:
    for spec, q_heads, kv_heads in SERVING_VARIANTS:
        for dtype in POINTER_TYPES:
            ptx = ptx_of(compile_variant(spec, q_heads, kv_heads, dtype))
            if not has_pdl_instructions(ptx):
                print(f"FAILED {spec.name} {dtype}: no griddepcontrol instructions", file=sys.stderr)
                return 1
        print(f"compiled {spec.name} q_heads={q_heads} kv_heads={kv_heads} for sm_90 with PDL")
    return 0


if __name__ == "__main__":
    run_compile_check(main)
