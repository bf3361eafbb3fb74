"""The Qwen3.5 line refuses what it does not run by name, before any weight is read, and reads both
checkpoint forms (text tower alone, or under `text_config` beside a vision tower and MTP head)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from models.checkpoint import StoredTensor
from models.config_fields import ConfigError
from models.qwen35.config import FULL, LINEAR, parse_qwen35_config
from models.qwen35.weights import LM_HEAD, NESTED_PREFIX, weight_map
from models.registry import ModelLoadError, ModelOptions, load_model

TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
    },
    "eos_token_id": 1,
}


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    """A checkpoint folder with a config and no weights: loading it can only fail before weights."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_text_config_parses_and_full_attention_every_fourth_layer(tmp_path: Path) -> None:
    config = parse_qwen35_config(write(tmp_path, TEXT))
    assert config.layer_types == (LINEAR, LINEAR, LINEAR, FULL)
    assert config.gdn.conv_dim == 2 * 2 * 16 + 4 * 16 and not config.nested


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("linear_conv_kernel_dim", 3, "conv kernel"),
        ("head_dim", 48, "power-of-two"),
        ("linear_key_head_dim", 512, "GDN head dims"),
        ("linear_num_value_heads", 3, "multiple of linear_num_key_heads"),
        ("mamba_ssm_dtype", "bfloat16", "not supported"),
        ("attn_output_gate", False, "gated full attention"),
        ("attention_bias", True, "bias"),
        ("hidden_act", "gelu", "hidden_act"),
        ("layer_types", ["linear_attention", "mamba", "linear_attention", "full_attention"], "mamba"),
    ],
)
def test_unsupported_values_are_refused_by_name_before_weights(
    tmp_path: Path, field: str, value: object, why: str
) -> None:
    path = write(tmp_path, TEXT | {field: value})
    with pytest.raises(ConfigError, match=why) as caught:
        load_model(str(path), ModelOptions(engine=EngineConfig(enable_prefix_caching=False), device="cpu"))
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("options", "why"),
    [
        (ModelOptions(device="cpu", gdn_backend="fla"), "--gdn-backend 'fla' is not available on CPU"),
        (ModelOptions(device="cpu", gdn_backend="flashinfer"), "--gdn-backend 'flashinfer'"),
        (ModelOptions(device="cpu", engine=EngineConfig(async_prefill=True)), "--async-prefill"),
    ],
)
def test_line_options_are_refused_by_name(tmp_path: Path, options: ModelOptions, why: str) -> None:
    with pytest.raises(ModelLoadError, match=why):
        load_model(str(write(tmp_path, TEXT)), options)


def test_nested_checkpoint_skips_vision_and_mtp_and_unties_by_what_is_stored(tmp_path: Path) -> None:
    outer = {
        "model_type": "qwen3_5",
        "text_config": TEXT | {"model_type": "qwen3_5_text"},
        "vision_config": {},
    }
    config = parse_qwen35_config(write(tmp_path, outer))
    assert config.nested

    def stored(*names: str) -> dict[str, StoredTensor]:
        return {n: StoredTensor(n, (1,), torch.float32, tmp_path / "x.safetensors") for n in names}

    tied = weight_map(config, stored("model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight"))
    assert all(name.startswith(NESTED_PREFIX) for name in tied.expected) and LM_HEAD not in tied.expected
    assert tied.skip("model.visual.blocks.0.attn.qkv.weight") and tied.skip("mtp.fc.weight")
    assert not tied.skip("model.layers.0.bogus")
    untied = weight_map(config, stored(LM_HEAD))
    assert LM_HEAD in untied.expected
    fp32 = [n for n, s in tied.expected.items() if s.load_dtype is torch.float32]
    assert sorted({n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in fp32}) == [
        "linear_attn.A_log",
        "norm.weight",
    ]


def test_a_nested_config_names_the_field_under_text_config(tmp_path: Path) -> None:
    outer = {"model_type": "qwen3_5", "text_config": TEXT | {"linear_conv_kernel_dim": 2}}
    with pytest.raises(ConfigError, match="conv kernel") as caught:
        load_model(str(write(tmp_path, outer)), ModelOptions(device="cpu"))
    assert caught.value.field == "text_config.linear_conv_kernel_dim", caught.value
