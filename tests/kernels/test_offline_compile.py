"""``compile_offline``: what it hands ``triton.compile`` for one kernel, and what it refuses.

The real sm_90 builds are the modules' compile checks (``sm90_compile``); here ``triton.compile``
is replaced in a child process (the test session interprets, and an interpreted kernel is not
what the compiler takes), so the signature, constexprs and divisibility attributes are checked
as values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from sm90_compile import REPO_ROOT

from kernels.triton.gated_act import _gated_act_kernel
from kernels.triton.offline import compile_offline, pointers_and_strides, storage_arg_type

_CHILD = """
import json, sys
import torch, triton
from kernels.triton.gated_act import _gated_act_kernel
from kernels.triton.offline import compile_offline, storage_arg_type

seen = {}

def record(source, target, options):
    seen.update(
        signature=source.signature,
        constexprs=[[list(key), str(value)] for key, value in source.constants.items()],
        attrs=[[list(key), value] for key, value in source.attrs.items()],
        target=[target.backend, target.arch, target.warp_size],
        options=options,
    )
    return "compiled"

triton.compile = record
result = compile_offline(
    _gated_act_kernel,
    {"KIND": 0, "STORAGE": 1, "BLOCK": 1024, "LIBDEVICE": True, "PDL": False},
    storage_arg_type(torch.float16),
    {"gate_up_ptr", "stride_in", "BLOCK"},
    arch=90,
    num_warps=8,
    enable_fp_fusion=False,
)
try:
    compile_offline(_gated_act_kernel, {}, storage_arg_type(torch.float16), {"stride_missing"})
except ValueError as error:
    seen["unknown"] = str(error)
json.dump({"result": result, **seen}, sys.stdout)
"""


def test_signature_constexprs_and_divisibility_from_the_module_rules() -> None:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert child.returncode == 0, child.stderr[-4000:]
    seen = json.loads(child.stdout)
    assert seen["result"] == "compiled"
    # _gated_act_kernel(gate_up_ptr, out_ptr, intermediate, stride_in, stride_out, KIND, STORAGE, BLOCK,
    # LIBDEVICE, PDL)
    assert seen["signature"] == {
        "gate_up_ptr": "*fp16",
        "out_ptr": "*fp16",
        "intermediate": "i32",
        "stride_in": "i32",
        "stride_out": "i32",
        "KIND": "constexpr",
        "STORAGE": "constexpr",
        "BLOCK": "constexpr",
        "LIBDEVICE": "constexpr",
        "PDL": "constexpr",
    }
    assert seen["constexprs"] == [[[5], "0"], [[6], "1"], [[7], "1024"], [[8], "True"], [[9], "False"]]
    # BLOCK is fixed by a constexpr, so it takes no divisibility hint although named aligned.
    assert seen["attrs"] == [[[0], [["tt.divisibility", 16]]], [[3], [["tt.divisibility", 16]]]]
    assert seen["target"] == ["cuda", 90, 32]
    assert seen["options"] == {"num_warps": 8, "enable_fp_fusion": False}
    assert "stride_missing" in seen["unknown"] and "_gated_act_kernel" in seen["unknown"]


def test_refused_under_the_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the session compiles for a GPU; the refusal is for interpreted sessions")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        compile_offline(_gated_act_kernel, {}, storage_arg_type(torch.float16))


def test_pointers_and_strides_names_only_those() -> None:
    assert pointers_and_strides(_gated_act_kernel) == {"gate_up_ptr", "out_ptr", "stride_in", "stride_out"}
