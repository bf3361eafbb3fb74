"""The Gemma 3 forward against transformers, and the loader on every checkpoint layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

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
def served(tiny_gemma3: Path) -> LoadedModel:
    return load_for_gate(tiny_gemma3, num_kv_pages=64)


def _config(tiny: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tiny / "config.json").read_text())
    return data


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def _copy_with(tiny: Path, out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    out.mkdir()
    for item in tiny.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, out / item.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def _against_transformers(checkpoint: Path, served: LoadedModel, length: int, seed: int) -> None:
    """fp32 on both sides: measured max |Δ| ~1e-6 on the tiny preset; a wrong norm form, scale,
    rope base or window moves it by ≥ 1e-2."""
    config = _config(checkpoint)
    tokens = random_prompt(length, seed=seed, vocab_size=config["vocab_size"])
    reference = hf_logprobs(hf_model(checkpoint, torch.device("cpu"), torch.float32), tokens)
    delta = logprob_delta(score(served, tokens), reference, tokens)
    assert delta.max_abs < 1e-4 and delta.argmax_agreement == 1.0, delta.describe()


def test_teacher_forced_logprobs_match_transformers(served: LoadedModel, tiny_gemma3: Path) -> None:
    _against_transformers(tiny_gemma3, served, 3 * _config(tiny_gemma3)["sliding_window"] + 5, seed=3)


def test_untied_head_and_logit_softcap_match_transformers(tiny_gemma3: Path, tmp_path: Path) -> None:
    """A stored LM head (tie_word_embeddings false) and a final soft-cap small enough to bite."""
    config = _config(tiny_gemma3) | {"tie_word_embeddings": False, "final_logit_softcapping": 0.5}
    tensors = _tensors(tiny_gemma3)
    generator = torch.Generator().manual_seed(5)
    tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=generator)
    variant = _copy_with(tiny_gemma3, tmp_path / "untied", tensors, config)
    _against_transformers(variant, load_for_gate(variant, num_kv_pages=64), 40, seed=6)


def test_linear_rope_scaling_matches_transformers(tiny_gemma3: Path, tmp_path: Path) -> None:
    """`rope_scaling: {linear, factor 8}` (the 4B-27B checkpoints' global layers), past the window."""
    config = _config(tiny_gemma3) | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    variant = _copy_with(tiny_gemma3, tmp_path / "linear", _tensors(tiny_gemma3), config)
    _against_transformers(
        variant, load_for_gate(variant, num_kv_pages=64), 3 * config["sliding_window"] + 5, 7
    )


@pytest.mark.parametrize(
    ("prefix", "head", "vision"),
    [
        ("model.language_model.", "lm_head.weight", "model.vision_tower.vision_model.post_layernorm.weight"),
        (
            "language_model.model.",
            "language_model.lm_head.weight",
            "vision_tower.vision_model.post_layernorm.weight",
        ),
    ],
)
def test_multimodal_layouts_serve_the_same_logits(
    served: LoadedModel, tiny_gemma3: Path, tmp_path: Path, prefix: str, head: str, vision: str
) -> None:
    """The tower nested as transformers 5 saves it and as the published checkpoints store it, beside
    vision tensors and a stored copy of the tied head, which are skipped."""
    text = _config(tiny_gemma3)
    tensors = {name.replace("model.", prefix, 1): t for name, t in _tensors(tiny_gemma3).items()}
    tensors[head] = tensors[prefix + "embed_tokens.weight"].clone()
    tensors[vision] = torch.zeros(4)
    tensors[vision.split("vision_tower")[0] + "multi_modal_projector.mm_input_projection_weight"] = (
        torch.zeros(4, 4)
    )
    outer = {"model_type": "gemma3", "text_config": text | {"model_type": "gemma3_text"}}
    nested = _copy_with(tiny_gemma3, tmp_path / "nested", tensors, outer)
    tokens = random_prompt(40, seed=4, vocab_size=text["vocab_size"])
    assert torch.equal(score(load_for_gate(nested, num_kv_pages=64), tokens), score(served, tokens))


def test_loader_names_every_faulty_tensor_at_once(tiny_gemma3: Path, tmp_path: Path) -> None:
    text = _config(tiny_gemma3)
    first_global = text["layer_types"].index("full_attention")
    tensors = _tensors(tiny_gemma3)
    missing = f"model.layers.{first_global}.self_attn.v_proj.weight"
    unexpected = "model.layers.0.layer_scalar"
    misshapen = "model.layers.1.self_attn.k_norm.weight"
    del tensors[missing]
    tensors[unexpected] = torch.ones(1)
    tensors[misshapen] = torch.ones(3)
    broken = _copy_with(tiny_gemma3, tmp_path / "broken", tensors, text)
    with pytest.raises(WeightsError) as info:
        load_for_gate(broken, num_kv_pages=16)
    assert len(info.value.problems) == 3, info.value.problems
    for name in (missing, unexpected, misshapen):
        assert name in str(info.value)
