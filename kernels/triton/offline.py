"""Ahead-of-time compilation of one Triton kernel variant for an NVIDIA arch, on a machine without
a GPU: the compile checks (``python -m kernels.triton.…``) build sm_90 cubins with the ptxas that
ships with Triton, since the interpreter accepts programs the GPU compiler rejects.

Each kernel module keeps what is its own (its constexprs, the signature type of each runtime
argument, which arguments serving shapes make divisible by 16, its compile options, the checks on
the PTX); this module turns them into the signature, constexprs and ``tt.divisibility`` attributes
that the runtime JIT would specialise on. docs/kernels.md tells how the compile checks are used.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import NoReturn

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, CompiledKernel

from kernels.triton.storage import POINTER_TYPES, interpreted


def storage_arg_type(dtype: torch.dtype) -> Callable[[str], str]:
    """The argument types of a kernel whose buffers all hold ``dtype``: a pointer (``…_ptr``) to
    ``dtype``, ``eps`` fp32, any other argument i32 (what the runtime JIT infers for sizes and
    strides below 2³¹)."""
    pointer = POINTER_TYPES[dtype]

    def arg_type(name: str) -> str:
        if name.endswith("_ptr"):
            return pointer
        return "fp32" if name == "eps" else "i32"

    return arg_type


def pointers_and_strides(fn: triton.JITFunction) -> set[str]:
    """``fn``'s pointers (``…_ptr``) and strides (``stride_…``): what serving shapes make divisible
    by 16 in most kernels (torch's buffers are 16-byte aligned, row widths multiples of 16)."""
    return {name for name in fn.arg_names if name.endswith("_ptr") or name.startswith("stride_")}


def compile_offline(
    fn: triton.JITFunction,
    constexprs: Mapping[str, object],
    arg_type: Callable[[str], str],
    aligned: Collection[str] = (),
    *,
    arch: int = 90,
    **options: object,
) -> CompiledKernel:
    """``fn`` compiled for ``sm_{arch}``: ``asm`` holds its PTX and cubin.

    ``constexprs`` fixes arguments by name; every other argument's signature type is
    ``arg_type(name)`` ("*bf16", "i32", "fp32", …); the arguments named in ``aligned`` are marked
    divisible by 16, except those ``constexprs`` fixes (a fixed value needs no hint). ``options``
    go to ``triton.compile`` as they are (num_warps, launch_pdl, enable_fp_fusion, …).
    """
    if interpreted():
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset")
    names = list(fn.arg_names)
    unknown = sorted((set(constexprs) | set(aligned)) - set(names))
    if unknown:
        raise ValueError(f"{fn.__name__} has no argument(s) {unknown}; its arguments are {names}")
    signature = {name: "constexpr" if name in constexprs else arg_type(name) for name in names}
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(name),): value for name, value in constexprs.items()},
        # As the runtime JIT marks a pointer or integer it sees divisible by 16: loads and stores
        # through it may then vectorise to 16 bytes.
        attrs={
            (index,): [["tt.divisibility", 16]]
            for index, name in enumerate(names)
            if name in aligned and name not in constexprs
        },
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def ptx_of(kernel: object) -> str:
    """A compiled kernel's PTX ("" when it has none)."""
    return str(getattr(kernel, "asm", {}).get("ptx", ""))


def has_cubin(kernel: object) -> bool:
    """Whether a compiled kernel carries its cubin (ptxas ran to the end)."""
    return bool(getattr(kernel, "asm", {}).get("cubin"))


def has_pdl_instructions(ptx: str) -> bool:
    """Whether PTX holds both PDL instructions (docs/kernels.md, "PDL"): a kernel launched with
    ``launch_pdl`` that lacks either would start early and never wait, or never let the next start."""
    return "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


def require_pdl_build(kernel: object, variant: str) -> None:
    """Raise naming ``variant`` unless the compiled kernel has its cubin and both PDL instructions."""
    if not has_cubin(kernel):
        raise RuntimeError(f"no cubin for {variant}")
    if not has_pdl_instructions(ptx_of(kernel)):
        raise RuntimeError(f"no PDL instructions for {variant}")


def check_variants(
    module: str, parameter: str, values: Iterable[int], compile_variant: Callable[[int, torch.dtype], object]
) -> int:
    """The compile check of a kernel whose variants vary in one shape parameter: every serving value
    of it in every storage dtype must build a cubin; a ``compiled …`` line per value."""
    for value in values:
        for dtype in POINTER_TYPES:
            if not has_cubin(compile_variant(value, dtype)):
                print(f"no cubin for {parameter}={value} {dtype}", file=sys.stderr)
                return 1
        print(f"compiled {module} {parameter}={value} for sm_90")
    return 0


def run_compile_check(main: Callable[[], int]) -> NoReturn:
    """A compile check's ``python -m kernels.triton.…`` entry: exits with ``main()``'s status, or
    refuses under ``TRITON_INTERPRET``, whose jit functions are interpreter objects that never compile."""
    if interpreted():
        sys.exit("unset TRITON_INTERPRET: the compile check builds real GPU code")
    sys.exit(main())
