"""Qwen3 config parsing fails closed, naming the field; both rope spellings are read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from models.config_fields import ConfigError
from models.qwen3.config import parse_qwen3_config

BASE: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_theta": 1000000,
    "eos_token_id": 299,
    "torch_dtype": "bfloat16",
}


def _write(tmp_path: Path, **changes: Any) -> Path:
    config = {k: v for k, v in (BASE | changes).items() if v is not ...}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_parses_the_published_layout(tmp_path: Path) -> None:
    config = parse_qwen3_config(_write(tmp_path))
    assert (config.q_size, config.kv_size, config.rope_theta) == (64, 32, 1e6)
    assert config.eos_token_ids == frozenset({299}) and not config.tie_word_embeddings


def test_reads_transformers5_rope_parameters_and_generation_eos(tmp_path: Path) -> None:
    path = _write(tmp_path, rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 299]}))
    config = parse_qwen3_config(path)
    assert config.rope_theta == 5e6 and config.eos_token_ids == frozenset({7, 299})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        (
            {"rope_theta": ..., "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}},
            "rope_parameters.rope_type",
        ),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"vocab_size": ...}, "vocab_size"),
    ],
)
def test_refuses_what_it_does_not_run_by_field_name(
    tmp_path: Path, changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_qwen3_config(_write(tmp_path, **changes))
    assert info.value.field == field
    assert repr(field) in str(info.value)
