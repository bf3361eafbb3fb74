"""The gates' transformers reference is the model `from_pretrained(dtype=...)` builds, buffers
included: a reference cast after loading once had RoPE's inv_freq rounded to bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gates.harness.hf_reference import hf_model
from models.synth.writer import SynthRequest, synthesize


@pytest.fixture(scope="module", params=["qwen3", "gemma4"])
def bf16_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"tiny-{request.param}-bf16")
    synthesize(SynthRequest(family=request.param, preset="tiny", out=out, dtype="bfloat16", device="cpu"))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reference_is_what_from_pretrained_builds(bf16_checkpoint: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    want = AutoModelForCausalLM.from_pretrained(str(bf16_checkpoint), dtype=dtype)
    got = hf_model(bf16_checkpoint, torch.device("cpu"), dtype)
    want_tensors = dict(want.named_parameters()) | dict(want.named_buffers())
    got_tensors = dict(got.named_parameters()) | dict(got.named_buffers())
    assert got_tensors.keys() == want_tensors.keys()
    for name, tensor in want_tensors.items():
        assert got_tensors[name].dtype == tensor.dtype, (
            f"{name}: {got_tensors[name].dtype}, want {tensor.dtype}"
        )
        assert torch.equal(got_tensors[name], tensor), f"{name}: values differ"
    rope = [name for name in want_tensors if name.endswith("inv_freq")]
    assert rope and all(got_tensors[name].dtype == torch.float32 for name in rope)
