"""Compile the decode attention kernels for sm_90 on a machine without a GPU.

The interpreter accepts programs the GPU compiler rejects (a dynamic loop whose bounds come from
a runtime `if`, fp32 `tl.dot` shapes), so the interpreter tests alone do not show the two kernels
build. This compiles the split and merge kernels at the serving geometries down to cubins with the
ptxas that ships with Triton, specialised as the runtime JIT specialises them (pointers and the
pool strides, multiples of 16, marked divisible by 16), and the split kernel with P·V in bf16
(``pv_storage``, what the serving backend runs) at ``PV_STORAGE_VARIANTS``; for each split kernel it
prints the registers and spills the cubin uses (``cuobjdump``, where Triton ships it). Run
without ``TRITON_INTERPRET``: ``python -m kernels.triton.decode_attention_aot``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

from kernels.attention.base import AttentionLayerSpec
from kernels.kv_layout import PAGE_SIZE
from kernels.triton.decode_attention import (
    NUM_WARPS,
    PROGRAMS_PER_HEAD,
    SPLIT_TOKENS,
    DecodeGeometry,
    _decode_attention_merge_kernel,
    _decode_attention_split_kernel,
    uses_tensor_cores,
)
from kernels.triton.offline import compile_offline, has_pdl_instructions, ptx_of, run_compile_check
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES, interpreted

# (q heads, kv heads, head dim, window, dtype): the attention layers of shared/presets.md that the
# kernel takes, plus head dim 64 and every storage dtype once.
SERVING_VARIANTS: tuple[tuple[int, int, int, int | None, torch.dtype], ...] = (
    (32, 8, 128, None, torch.bfloat16),  # Qwen3-4B
    (32, 8, 128, None, torch.float16),
    (32, 8, 128, None, torch.float32),
    (16, 4, 256, None, torch.bfloat16),  # Qwen3.5 full attention
    (16, 8, 256, 1024, torch.bfloat16),  # Gemma 4 12B sliding
    (4, 1, 256, 512, torch.bfloat16),  # Gemma 3 sliding
    (8, 8, 64, None, torch.bfloat16),
)

# (q heads, kv heads, head dim, window): the split kernel with P·V in the storage dtype
# (`pv_storage`, what the serving backend runs) at every bf16 geometry of SERVING_VARIANTS.
PV_STORAGE_VARIANTS: tuple[tuple[int, int, int, int | None], ...] = tuple(
    (heads, kv_heads, head_dim, window)
    for heads, kv_heads, head_dim, window, dtype in SERVING_VARIANTS
    if dtype == torch.bfloat16
)
_INT_POINTERS = ("table_ptr", "kv_len_ptr")
_FP32_POINTERS = ("acc_ptr", "ml_ptr")


def _compile(
    fn: triton.JITFunction, constexprs: dict[str, object], dtype: torch.dtype, aligned: set[str], arch: int
) -> object:
    """``fn`` (split or merge) compiled with this module's argument types and options; every
    pointer is 16-byte aligned besides the strides named in ``aligned``."""

    def arg_type(name: str) -> str:
        if name in _INT_POINTERS:
            return "*i32"
        if name in _FP32_POINTERS:
            return "*fp32"
        if name.endswith("_ptr"):
            return POINTER_TYPES[dtype]
        return "fp32" if name == "scale" else "i32"

    pointers = {name for name in fn.arg_names if name.endswith("_ptr")}
    return compile_offline(
        fn,
        constexprs,
        arg_type,
        pointers | aligned,
        arch=arch,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
        launch_pdl=bool(constexprs["PDL"]),
    )


def compile_variant(
    layer: AttentionLayerSpec,
    dtype: torch.dtype,
    *,
    arch: int = 90,
    pdl: bool = True,
    pv_storage: bool = False,
) -> tuple[object, object]:
    """The compiled (split, merge) kernels for one layer geometry and storage dtype on ``sm_{arch}``,
    PDL on as a GPU of that arch launches them (or off); with ``pv_storage``, the split kernel's
    P·V dot in the storage dtype."""
    if interpreted():
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset")
    geometry = DecodeGeometry.of(layer)
    shared: dict[str, object] = {
        "KV_HEADS": layer.num_kv_heads,
        "GROUP": geometry.group,
        "HEAD_DIM": layer.head_dim,
        "SPLIT": SPLIT_TOKENS,
        "PROGRAMS": PROGRAMS_PER_HEAD,
        "HAS_WINDOW": layer.window is not None,
        "PDL": pdl,
    }
    # Pool strides are multiples of 16 elements at every serving geometry; q's row and head
    # strides too (q is dense, or a view of a fused QKV projection whose widths are).
    pool_strides = {
        "stride_page",
        "stride_kv",
        "stride_token",
        "stride_head",
        "stride_q_row",
        "stride_q_head",
    }
    split = _compile(
        _decode_attention_split_kernel,
        {
            **shared,
            "GROUP_PAD": geometry.group_pad,
            "BLOCK_N": geometry.block_n(),
            "PAGE": PAGE_SIZE,
            "TENSOR_CORES": uses_tensor_cores(dtype),
            "PV_STORAGE": pv_storage and uses_tensor_cores(dtype),
        },
        dtype,
        pool_strides,
        arch,
    )
    merge = _compile(
        _decode_attention_merge_kernel,
        {**shared, "STORAGE": STORAGE_TYPES[dtype]},
        dtype,
        {"stride_out_row", "stride_out_head"},
        arch,
    )
    return split, merge


def _waits_on_the_grid(kernel: object) -> bool:
    """Whether a kernel's PTX has both PDL instructions."""
    return has_pdl_instructions(ptx_of(kernel))


def resource_usage(kernel: object) -> str:
    """``registers=… spill_bytes=…`` of a compiled kernel's cubin, read with the ``cuobjdump``
    that ships with Triton ("" when it is not there or says nothing)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = getattr(kernel, "asm", {}).get("cubin")
    if not cubin or not os.access(tool, os.X_OK):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        result = subprocess.run(
            [str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True, check=False
        )
    registers = re.search(r"REG:(\d+)", result.stdout)
    stack = re.search(r"STACK:(\d+)", result.stdout)
    if registers is None:
        return ""
    return f"registers={registers[1]} stack_bytes={stack[1] if stack else '?'}"


def _check(kernels: tuple[object, object], name: str, failures: list[str]) -> bool:
    if not all(kernel.asm.get("cubin") for kernel in kernels):  # type: ignore[attr-defined]
        failures.append(f"{name}: no cubin")
        return False
    if not all(_waits_on_the_grid(kernel) for kernel in kernels):
        failures.append(f"{name}: no griddepcontrol instructions")
        return False
    return True


def main() -> int:
    failures: list[str] = []
    for heads, kv_heads, head_dim, window, dtype in SERVING_VARIANTS:
        layer = AttentionLayerSpec(heads, kv_heads, head_dim, head_dim**-0.5, window)
        kernels = compile_variant(layer, dtype)
        name = f"q_heads={heads} kv_heads={kv_heads} head_dim={head_dim} window={window} {dtype}"
        if _check(kernels, name, failures):
            print(
                f"compiled decode attention {name} for sm_90 with PDL (split: {resource_usage(kernels[0])})"
            )
    for heads, kv_heads, head_dim, window in PV_STORAGE_VARIANTS:
        layer = AttentionLayerSpec(heads, kv_heads, head_dim, head_dim**-0.5, window)
        kernels = compile_variant(layer, torch.bfloat16, pv_storage=True)
        name = f"q_heads={heads} kv_heads={kv_heads} head_dim={head_dim} window={window}"
        if _check(kernels, name, failures):
            print(
                f"compiled decode attention, P·V in bf16, {name} for sm_90 with PDL "
                f"(split: {resource_usage(kernels[0])})"
            )
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    run_compile_check(main)
