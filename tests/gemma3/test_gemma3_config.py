"""Gemma 3 config parsing: both RoPE spellings, the multimodal outer config, and every fact this
line needs refused by name when it is missing or unsupported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from models.config_fields import ConfigError
from models.gemma3.config import GLOBAL, SLIDING, Rope, parse_gemma3_config


def _raw(tiny: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tiny / "config.json").read_text())
    return data


def _write(tmp: Path, tiny: Path, config: dict[str, Any], name: str = "ckpt") -> Path:
    out = tmp / name
    out.mkdir()
    shutil.copy(tiny / "generation_config.json", out / "generation_config.json")
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_tiny_config(tiny_gemma3: Path) -> None:
    c = parse_gemma3_config(tiny_gemma3)
    raw = _raw(tiny_gemma3)
    assert c.layer_types == tuple(raw["layer_types"]) and c.layer_types[-1] == SLIDING
    assert c.layers_of(GLOBAL) == (2, 5)
    assert (c.rope(SLIDING), c.rope(GLOBAL)) == (Rope(10000.0), Rope(1000000.0))
    assert c.attention_scale == 24**-0.5 != c.head_dim**-0.5
    assert c.sliding_window == 12 and c.final_logit_softcapping is None and c.tie_word_embeddings
    # EOS from generation_config.json (<eos>, <end_of_turn>), not config.json's single id.
    assert c.eos_token_ids == frozenset({1, 106}) and c.bos_token_id == 2
    assert c.dtype == "float32"


def test_transformers5_spelling_and_pattern_give_the_same_config(tiny_gemma3: Path, tmp_path: Path) -> None:
    want = parse_gemma3_config(tiny_gemma3)
    raw = _raw(tiny_gemma3)
    raw["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": raw.pop("rope_local_base_freq")},
        "full_attention": {"rope_type": "default", "rope_theta": raw.pop("rope_theta")},
    }
    raw.pop("rope_scaling")
    raw.pop("layer_types")
    raw["sliding_window_pattern"] = 3
    assert parse_gemma3_config(_write(tmp_path, tiny_gemma3, raw)) == want


def test_multimodal_outer_config(tiny_gemma3: Path, tmp_path: Path) -> None:
    want = parse_gemma3_config(tiny_gemma3)
    text = _raw(tiny_gemma3)
    text.pop("torch_dtype")
    outer = {
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"},
        "torch_dtype": "bfloat16",
    }
    got = parse_gemma3_config(_write(tmp_path, tiny_gemma3, outer))
    assert got.dtype == "bfloat16"
    assert got.layer_types == want.layer_types and got.attention_scale == want.attention_scale


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("attn_logit_softcapping", 50.0),
        ("use_bidirectional_attention", True),
        ("attention_bias", True),
        ("hidden_activation", "silu"),
        ("rope_scaling", {"rope_type": "dynamic", "factor": 8.0}),
        ("rope_scaling", {"rope_type": "linear"}),
        ("layer_types", ["sliding_attention"] * 6 + ["chunked_attention"]),
        ("num_key_value_heads", 3),
    ],
)
def test_unsupported_features_are_refused_by_name(
    tiny_gemma3: Path, tmp_path: Path, field: str, value: object
) -> None:
    raw = _raw(tiny_gemma3) | {field: value}
    with pytest.raises(ConfigError) as info:
        parse_gemma3_config(_write(tmp_path, tiny_gemma3, raw))
    assert info.value.field == field, info.value


@pytest.mark.parametrize(
    ("field", "named"),
    [
        ("query_pre_attn_scalar", "query_pre_attn_scalar"),
        ("rope_local_base_freq", "rope_local_base_freq"),
        ("rope_theta", "rope_theta"),
        ("layer_types", "layer_types"),
        ("sliding_window", "sliding_window"),
        ("head_dim", "head_dim"),
    ],
)
def test_gemma3_facts_are_required_not_defaulted(
    tiny_gemma3: Path, tmp_path: Path, field: str, named: str
) -> None:
    raw = _raw(tiny_gemma3)
    raw.pop(field)
    with pytest.raises(ConfigError) as info:
        parse_gemma3_config(_write(tmp_path, tiny_gemma3, raw))
    assert info.value.field == named, info.value


def test_linear_rope_scaling_in_both_spellings(tiny_gemma3: Path, tmp_path: Path) -> None:
    """The 4B-27B checkpoints' `rope_scaling: {linear, factor 8}` applies to global layers only."""
    raw = _raw(tiny_gemma3) | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    published = parse_gemma3_config(_write(tmp_path, tiny_gemma3, raw, name="published"))
    assert (published.rope(SLIDING), published.rope(GLOBAL)) == (Rope(10000.0), Rope(1000000.0, 8.0))
    raw.pop("rope_scaling")
    raw["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": raw.pop("rope_local_base_freq")},
        "full_attention": {"rope_type": "linear", "rope_theta": raw.pop("rope_theta"), "factor": 8.0},
    }
    assert parse_gemma3_config(_write(tmp_path, tiny_gemma3, raw, name="transformers5")) == published


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0}, "rope_parameters.full_attention.rope_type"),
        ({"rope_type": "linear", "rope_theta": 1e6}, "rope_parameters.full_attention.rope_type"),
        ({"rope_type": "default", "rope_theta": 1e6, "factor": 8.0}, "rope_parameters.full_attention.factor"),
        (
            {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
            "rope_parameters.full_attention.partial_rotary_factor",
        ),
    ],
)
def test_unsupported_rope_parameters_are_refused_by_name(
    tiny_gemma3: Path, tmp_path: Path, entry: dict[str, Any], field: str
) -> None:
    raw = _raw(tiny_gemma3)
    for key in ("rope_scaling", "rope_theta", "rope_local_base_freq"):
        raw.pop(key)
    raw["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": entry,
    }
    with pytest.raises(ConfigError) as info:
        parse_gemma3_config(_write(tmp_path, tiny_gemma3, raw))
    assert info.value.field == field, info.value
