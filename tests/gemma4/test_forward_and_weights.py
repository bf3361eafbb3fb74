"""The Gemma 4 forward against transformers, and the loader on both checkpoint namings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gates.harness.compare import logprob_delta
from gates.harness.hf_reference import hf_logprobs, hf_model
from gates.harness.serving import load_for_gate, random_prompt, score
from models.checkpoint import WeightsError
from models.registry import LoadedModel


@pytest.fixture(scope="module")
def served(tiny_gemma4: Path) -> LoadedModel:
    return load_for_gate(tiny_gemma4, num_kv_pages=64)


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def _copy_with(tiny: Path, out: Path, tensors: dict[str, torch.Tensor], config: dict[str, object]) -> Path:
    out.mkdir()
    for item in tiny.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, out / item.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_teacher_forced_logprobs_match_transformers(served: LoadedModel, tiny_gemma4: Path) -> None:
    """fp32 on both sides: measured mean |Δ| ~1e-6; a wrong norm, rope or mask moves it by ≥ 1e-2."""
    config = json.loads((tiny_gemma4 / "config.json").read_text())
    tokens = random_prompt(3 * config["sliding_window"] + 5, seed=3, vocab_size=config["vocab_size"])
    reference = hf_logprobs(hf_model(tiny_gemma4, torch.device("cpu"), torch.float32), tokens)
    delta = logprob_delta(score(served, tokens), reference, tokens)
    assert delta.max_abs < 1e-4 and delta.argmax_agreement == 1.0, delta.describe()


def test_nested_multimodal_naming_serves_the_same_logits(
    served: LoadedModel, tiny_gemma4: Path, tmp_path: Path
) -> None:
    text = json.loads((tiny_gemma4 / "config.json").read_text())
    tensors = {
        name.replace("model.", "model.language_model.", 1): t for name, t in _tensors(tiny_gemma4).items()
    }
    tensors["model.vision_tower.encoder.layers.0.mlp.fc1.weight"] = torch.zeros(4, 4)
    tensors["model.embed_audio.embedding_projection.weight"] = torch.zeros(4, 4)
    outer = {"model_type": "gemma4", "text_config": text | {"model_type": "gemma4_text"}}
    nested = _copy_with(tiny_gemma4, tmp_path / "nested", tensors, outer)
    tokens = random_prompt(40, seed=4, vocab_size=text["vocab_size"])
    got = score(load_for_gate(nested, num_kv_pages=64), tokens)
    assert torch.equal(got, score(served, tokens))


def test_loader_names_every_faulty_tensor_at_once(tiny_gemma4: Path, tmp_path: Path) -> None:
    text = json.loads((tiny_gemma4 / "config.json").read_text())
    first_global = text["layer_types"].index("full_attention")
    tensors = _tensors(tiny_gemma4)
    missing = "model.layers.0.self_attn.v_proj.weight"
    unexpected = f"model.layers.{first_global}.self_attn.v_proj.weight"
    misshapen = "model.layers.1.layer_scalar"
    del tensors[missing]
    tensors[unexpected] = torch.zeros(4, 4)
    tensors[misshapen] = torch.ones(2)
    broken = _copy_with(tiny_gemma4, tmp_path / "broken", tensors, text)
    with pytest.raises(WeightsError) as info:
        load_for_gate(broken, num_kv_pages=16)
    assert len(info.value.problems) == 3, info.value.problems
    for name in (missing, unexpected, misshapen):
        assert name in str(info.value)
