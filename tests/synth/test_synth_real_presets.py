"""The published-size presets carry the dimensions of shared/presets.md, and transformers reads
their config.json as that architecture. Config and meta-device tensor shapes only: no weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from models.synth.config_build import config_body, generation_body
from models.synth.families import get_family
from models.synth.tensors import plan_tensors
from models.synth.tokenizer_build import BuiltTokenizer

BuildTokenizer = Callable[[str, str, int], BuiltTokenizer]

# Straight from shared/presets.md (field → value per preset).
QWEN3 = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip
QWEN3_SHARED = dict(vocab_size=151936, rms_norm_eps=1e-06, max_position_embeddings=40960, rope_theta=1000000,
                    rope_scaling=None, attention_bias=False, hidden_act="silu", use_sliding_window=False,
                    bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")  # fmt: skip

GEMMA4 = {
    "12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                num_key_value_heads=8, num_global_key_value_heads=1),
    "31b": dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                num_key_value_heads=16, num_global_key_value_heads=4),
}  # fmt: skip
GEMMA4_SHARED = dict(head_dim=256, global_head_dim=512, vocab_size=262144, vocab_size_per_layer_input=262144,
                     tie_word_embeddings=True, rms_norm_eps=1e-06, max_position_embeddings=262144,
                     sliding_window=1024, attention_k_eq_v=True, final_logit_softcapping=30.0,
                     hidden_activation="gelu_pytorch_tanh", num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                     enable_moe_block=False, use_bidirectional_attention="vision", use_double_wide_mlp=False,
                     attention_bias=False, bos_token_id=2, eos_token_id=1, pad_token_id=0, dtype="bfloat16",
                     rope_parameters={
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                            "partial_rotary_factor": 0.25},
                     })  # fmt: skip

QWEN35 = {
    "4b": dict(hidden_size=2560, intermediate_size=9216, tie_word_embeddings=True),
    "9b": dict(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False),
}
QWEN35_SHARED = dict(num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                     vocab_size=248320, rms_norm_eps=1e-06, max_position_embeddings=262144,
                     linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                     linear_num_key_heads=16, linear_num_value_heads=32, attn_output_gate=True,
                     full_attention_interval=4, mamba_ssm_dtype="float32", bos_token_id=248044,
                     eos_token_id=248044, dtype="bfloat16",
                     rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                      "mrope_interleaved": True, "mrope_section": [11, 11, 10]})  # fmt: skip

CASES = [
    *(("qwen3", name, {**QWEN3_SHARED, **dims}) for name, dims in QWEN3.items()),
    *(("gemma4", name, {**GEMMA4_SHARED, **dims}) for name, dims in GEMMA4.items()),
    *(("qwen35", name, {**QWEN35_SHARED, **dims}) for name, dims in QWEN35.items()),
]


@pytest.fixture
def published_config(tokenizer_for: BuildTokenizer) -> Callable[[str, str], dict[str, Any]]:
    """config.json of a preset with its default tokenizer (the real vocabulary for Qwen)."""

    def body(family_name: str, preset_name: str) -> dict[str, Any]:
        family = get_family(family_name)
        preset = family.preset(preset_name)
        built = tokenizer_for(family_name, preset.default_tokenizer, preset.vocab_size)
        return config_body(family, preset, preset.vocab_size, built, preset.default_dtype, "test")

    return body


@pytest.mark.parametrize(("family", "preset", "expected"), CASES, ids=[f"{f}-{p}" for f, p, _ in CASES])
def test_published_presets_carry_the_published_dimensions(
    published_config: Callable[[str, str], dict[str, Any]], family: str, preset: str, expected: dict[str, Any]
) -> None:
    body = published_config(family, preset)
    assert {key: body[key] for key in expected} == expected


def test_layer_patterns_match_the_published_files(
    published_config: Callable[[str, str], dict[str, Any]],
) -> None:
    gemma_12b = published_config("gemma4", "12b")["layer_types"]
    assert [i for i, kind in enumerate(gemma_12b) if kind == "full_attention"] == list(range(5, 48, 6))
    gemma_31b = published_config("gemma4", "31b")["layer_types"]
    assert [i for i, kind in enumerate(gemma_31b) if kind == "full_attention"] == list(range(5, 60, 6))
    qwen35 = published_config("qwen35", "9b")["layer_types"]
    assert [i for i, kind in enumerate(qwen35) if kind == "full_attention"] == list(range(3, 32, 4))
    assert qwen35.count("linear_attention") == 24


@pytest.mark.parametrize(
    ("family", "preset", "parameters"),
    [
        # Roughly the published text-model sizes; the exact count is pinned by the shapes below.
        ("qwen3", "0.6b", (0.55e9, 0.65e9)),
        ("qwen3", "8b", (8.0e9, 8.4e9)),
        ("gemma4", "31b", (30e9, 32e9)),
        ("qwen35", "9b", (8.5e9, 9.6e9)),
    ],
)
def test_transformers_reads_the_config_as_that_architecture(
    published_config: Callable[[str, str], dict[str, Any]],
    tmp_path: Path,
    family: str,
    preset: str,
    parameters: tuple[float, float],
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(published_config(family, preset)))
    specs = {spec.name: spec for spec in plan_tensors(tmp_path, torch.bfloat16)}
    total = sum(spec.numel for spec in specs.values())
    assert parameters[0] < total < parameters[1], total
    if family == "gemma4":
        # Global layer 5 of the 31B: 32 query heads of 512, 4 K=V heads of 512, no v_proj.
        assert specs["model.layers.5.self_attn.q_proj.weight"].shape == (32 * 512, 5376)
        assert specs["model.layers.5.self_attn.k_proj.weight"].shape == (4 * 512, 5376)
        assert "model.layers.5.self_attn.v_proj.weight" not in specs
        assert specs["model.layers.4.self_attn.v_proj.weight"].shape == (16 * 256, 5376)
        assert "lm_head.weight" not in specs
    if family == "qwen35":
        assert specs["model.layers.3.self_attn.q_proj.weight"].shape == (2 * 16 * 256, 4096)
        assert specs["model.layers.0.linear_attn.A_log"].shape == (32,)
        assert "lm_head.weight" in specs
    if family == "qwen3" and preset == "0.6b":
        assert specs["model.layers.0.self_attn.q_proj.weight"].shape == (16 * 128, 1024)
        assert "lm_head.weight" not in specs


def test_generation_configs_carry_the_stop_sets(tokenizer_for: BuildTokenizer) -> None:
    expectations = {
        ("gemma4", "trained", 262144): [1, 106, 50],
        ("qwen3", "real", 151936): [151645, 151643],
        # Qwen3.5 ships no generation_config.json; the written one holds the effective stop set.
        ("qwen35", "real", 248320): [248046, 248044],
    }
    for (family_name, kind, vocab_size), eos in expectations.items():
        body = generation_body(get_family(family_name), tokenizer_for(family_name, kind, vocab_size), "test")
        assert body["eos_token_id"] == eos
    gemma = generation_body(get_family("gemma4"), tokenizer_for("gemma4", "trained", 262144), "test")
    assert (gemma["top_k"], gemma["top_p"], gemma["temperature"]) == (64, 0.95, 1.0)
    qwen3 = generation_body(get_family("qwen3"), tokenizer_for("qwen3", "real", 151936), "test")
    assert (qwen3["bos_token_id"], qwen3["pad_token_id"], qwen3["top_k"]) == (151643, 151643, 20)
