"""The gates' transformers reference is the model `from_pretrained(dtype=...)` builds, buffers
included: a reference cast after loading once had RoPE's inv_freq rounded to bf16."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gates.harness.hf_reference import (
    WORKING_MARGIN_BYTES,
    forward_headroom,
    hf_logprobs,
    hf_model,
    is_parked,
    make_resident,
    model_bytes,
)
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


@dataclass(slots=True)
class FixedBudget:
    """A device of `budget` bytes, less what `models` hold there while not parked: the free-memory
    query residency makes, without CUDA (the references' home is the host, so moves are no-ops)."""

    budget: int
    models: list[Any]

    def free_bytes(self, device: torch.device) -> int | None:
        return self.budget - sum(model_bytes(m) for m in self.models if not is_parked(m))


CPU = torch.device("cpu")
ROOMY = FixedBudget(budget=1 << 50, models=[])


def _pair(checkpoint: Path) -> tuple[Any, Any]:
    """The gates' pair: transformers at bf16 and in fp32, both homed on the (fake) device."""
    return hf_model(checkpoint, CPU, torch.bfloat16, ROOMY), hf_model(checkpoint, CPU, torch.float32, ROOMY)


def test_a_reference_parks_the_other_only_when_the_device_is_short(bf16_checkpoint: Path) -> None:
    narrow, wide = _pair(bf16_checkpoint)
    tokens = list(range(1, 12))
    headroom = forward_headroom(wide, len(tokens))
    both = model_bytes(narrow) + model_bytes(wide)

    make_resident(wide, headroom, FixedBudget(both + headroom, [narrow, wide]))
    assert not is_parked(narrow) and not is_parked(wide)

    short = FixedBudget(both + headroom - 1, [narrow, wide])
    want_wide, want_narrow = hf_logprobs(wide, tokens, ROOMY), hf_logprobs(narrow, tokens, ROOMY)
    got_wide = hf_logprobs(wide, tokens, short)
    assert is_parked(narrow) and not is_parked(wide)
    assert torch.equal(got_wide, want_wide)

    # Coming back, the parked one needs its own bytes too: the fp32 one now makes way for it.
    got_narrow = hf_logprobs(narrow, tokens, short)
    assert is_parked(wide) and not is_parked(narrow)
    assert torch.equal(got_narrow, want_narrow)
    assert torch.equal(hf_logprobs(wide, tokens, short), want_wide)
    assert is_parked(narrow) and not is_parked(wide)
    assert all(b.dtype == torch.float32 for name, b in narrow.named_buffers() if name.endswith("inv_freq"))


def test_the_fp32_build_parks_the_other_reference_before_widening_on_the_device(
    bf16_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    narrow, widened = _pair(bf16_checkpoint)
    # The build holds the stored (bf16) and the widened model at once, beside `narrow`.
    transient = model_bytes(narrow) + model_bytes(widened) + WORKING_MARGIN_BYTES
    wide = hf_model(
        bf16_checkpoint, CPU, torch.float32, FixedBudget(model_bytes(narrow) + transient - 1, [narrow])
    )
    assert is_parked(narrow) and not is_parked(wide)
    assert "widening the fp32 reference on the host" not in capsys.readouterr().out


def test_the_fp32_build_widens_on_the_host_when_the_device_is_short(
    bf16_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    stored, widened = (model_bytes(m) for m in _pair(bf16_checkpoint))
    # Room for the widened model but not for it beside the stored one.
    got = hf_model(
        bf16_checkpoint, CPU, torch.float32, FixedBudget(stored + widened + WORKING_MARGIN_BYTES - 1, [])
    )
    assert "widening the fp32 reference on the host" in capsys.readouterr().out
    want = AutoModelForCausalLM.from_pretrained(str(bf16_checkpoint), dtype=torch.float32)
    want_tensors = dict(want.named_parameters()) | dict(want.named_buffers())
    got_tensors = dict(got.named_parameters()) | dict(got.named_buffers())
    assert got_tensors.keys() == want_tensors.keys()
    for name, tensor in want_tensors.items():
        assert got_tensors[name].dtype == tensor.dtype and torch.equal(got_tensors[name], tensor), name


def test_a_dropped_reference_is_not_kept_alive(bf16_checkpoint: Path) -> None:
    model = hf_model(bf16_checkpoint, CPU, torch.bfloat16, ROOMY)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
