"""Gemma 4 config parsing: every accepted spelling, and each unsupported feature refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from models.config_fields import ConfigError
from models.gemma4.config import GLOBAL, SLIDING, parse_gemma4_config


def _text_config(tiny: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tiny / "config.json").read_text())
    return data


def _write(tmp: Path, tiny: Path, config: dict[str, Any], name: str = "ckpt") -> Path:
    out = tmp / name
    out.mkdir()
    shutil.copy(tiny / "generation_config.json", out / "generation_config.json")
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_tiny_text_config(tiny_gemma4: Path) -> None:
    c = parse_gemma4_config(tiny_gemma4)
    raw = _text_config(tiny_gemma4)
    assert c.layer_types == tuple(raw["layer_types"])
    assert c.sliding.head_dim == raw["head_dim"] and c.sliding.num_kv_heads == raw["num_key_value_heads"]
    assert c.full.head_dim == raw["global_head_dim"]
    assert c.full.num_kv_heads == raw["num_global_key_value_heads"]
    assert c.full.proportional and c.full.partial_rotary_factor == 0.25 and not c.sliding.proportional
    assert c.sliding_window == raw["sliding_window"]
    assert c.final_logit_softcapping == 30.0
    # EOS from generation_config.json, not config.json's single id.
    assert c.eos_token_ids == frozenset({1, 106, 50})
    assert c.layers_of(GLOBAL) == tuple(i for i, t in enumerate(raw["layer_types"]) if t == GLOBAL)
    assert set(c.layers_of(SLIDING)) | set(c.layers_of(GLOBAL)) == set(range(c.num_layers))


@pytest.mark.parametrize("outer_type", ["gemma4", "gemma4_unified"])
def test_multimodal_outer_config_and_per_layer_spelling(
    tiny_gemma4: Path, tmp_path: Path, outer_type: str
) -> None:
    text = _text_config(tiny_gemma4)
    want = parse_gemma4_config(tiny_gemma4)
    head_dim, kv = text.pop("global_head_dim"), text.pop("num_global_key_value_heads")
    text["per_layer_config"] = {
        str(i): {"head_dim": head_dim, "num_key_value_heads": kv}
        for i, t in enumerate(text["layer_types"])
        if t == GLOBAL
    }
    text["model_type"] = f"{outer_type}_text"
    text.pop("dtype")
    outer = {"model_type": outer_type, "text_config": text, "dtype": "bfloat16", "eos_token_id": [1, 106]}
    got = parse_gemma4_config(_write(tmp_path, tiny_gemma4, outer))
    assert got.full == want.full and got.sliding == want.sliding
    assert got.dtype == "bfloat16"
    assert got.eos_token_ids == want.eos_token_ids


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_kv_shared_layers", 2),
        ("hidden_size_per_layer_input", 256),
        ("enable_moe_block", True),
        ("attention_k_eq_v", False),
        ("attention_bias", True),
        ("hidden_activation", "silu"),
        ("use_bidirectional_attention", "all"),
    ],
)
def test_unsupported_features_are_refused_by_name(
    tiny_gemma4: Path, tmp_path: Path, field: str, value: object
) -> None:
    config = _text_config(tiny_gemma4) | {field: value}
    with pytest.raises(ConfigError) as info:
        parse_gemma4_config(_write(tmp_path, tiny_gemma4, config))
    assert info.value.field == field, info.value


def test_nested_unsupported_field_names_its_path(tiny_gemma4: Path, tmp_path: Path) -> None:
    text = _text_config(tiny_gemma4) | {"enable_moe_block": True}
    outer = {"model_type": "gemma4", "text_config": text}
    with pytest.raises(ConfigError) as info:
        parse_gemma4_config(_write(tmp_path, tiny_gemma4, outer))
    assert info.value.field == "text_config.enable_moe_block"


def test_per_layer_override_outside_global_layers_is_refused(tiny_gemma4: Path, tmp_path: Path) -> None:
    config = _text_config(tiny_gemma4)
    config["per_layer_config"] = {"0": {"head_dim": 64}}
    with pytest.raises(ConfigError) as info:
        parse_gemma4_config(_write(tmp_path, tiny_gemma4, config, "sliding"))
    assert info.value.field == "per_layer_config.0"
    config["per_layer_config"] = {"2": {"head_dim": 32, "sliding_window": 4}}
    with pytest.raises(ConfigError) as info:
        parse_gemma4_config(_write(tmp_path, tiny_gemma4, config, "extra"))
    assert info.value.field == "per_layer_config.2.sliding_window"


def test_last_layer_must_be_global(tiny_gemma4: Path, tmp_path: Path) -> None:
    config = _text_config(tiny_gemma4)
    config["layer_types"] = [*config["layer_types"][:-1], SLIDING]
    with pytest.raises(ConfigError) as info:
        parse_gemma4_config(_write(tmp_path, tiny_gemma4, config))
    assert info.value.field == "layer_types"
