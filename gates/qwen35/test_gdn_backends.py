"""Every GDN backend this GPU can run computes the spec: output and final state of the gated delta
rule against `kernels.reference` in fp64, at the checkpoint's GDN geometry.

Batches (kernels/gdn/agreement.py): varlen lengths 1, 2, 63, 64, 65, 127, 128, 4096 in one call
and a 64-row decode step, from zero and from random initial states, mild and strong decay, read
from and written to pool slots that are neither in order nor contiguous, with sentinel slots that
must survive. Bounds are the spec's own error measured in the same run (fp32: its fp32 error × 64,
or one TF32 rounding of q̂, k̂ in the spec × 1 for a backend whose kernels round fp32 dots to TF32,
as fla's triangular solve does on sm_80+; bf16: one rounding of q̂, k̂ in the spec × 8); each
comparison prints its figures.

fla is the GPU backend this project ships, so its absence fails the gate (install `infer[gdn]`);
FlashInfer is checked where it imports (flashinfer-python + nvidia-cutlass-dsl on sm_90), and its
refusal is printed otherwise. fp32 cases run with `TRITON_F32_DEFAULT=ieee`: fla's fp32 `tl.dot`
would otherwise be TF32, which is not the fp32 this comparison is about.
"""

from __future__ import annotations

import os

import torch

from gates.harness.serving import gate_device
from kernels.gdn import GDNGeometry, available_gdn_backends
from kernels.gdn.agreement import AgreementRun, gate_cases
from models.qwen35.config import Qwen35Config

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

# The dtypes each backend takes: FlashInfer's SM90 kernel is bf16/fp16 only.
DTYPES = {
    "torch": (torch.float32, torch.bfloat16),
    "fla": (torch.float32, torch.bfloat16),
    "flashinfer": (torch.bfloat16,),
}


def test_gdn_backends_agree(qwen35_config: Qwen35Config) -> None:
    device = gate_device()
    assert device.type == "cuda", "gdn_backends_agree needs a GPU (needs = gpu)"
    g = qwen35_config.gdn
    geometry = GDNGeometry(g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim)
    built, refused = available_gdn_backends(device)
    for name, why in refused.items():
        print(f"not checked: {name}: {why}")
    assert "fla" in built, f"the fla backend does not build here: {refused.get('fla')}"
    print(f"{torch.cuda.get_device_name(device)}, geometry {geometry}")
    failures = []
    runs = {
        case: AgreementRun(case, device) for case in gate_cases(geometry, (torch.float32, torch.bfloat16))
    }
    for name, backend in built.items():
        for case, run in runs.items():
            if case.dtype not in DTYPES[name]:
                continue
            agreement = run.check(backend)
            print(agreement.line())
            if not agreement.passed:
                failures.append(agreement.line())
    assert not failures, "\n".join(failures)
