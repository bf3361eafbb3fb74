"""Gemma 4 (text model type `gemma4_text`): presets from the published google/gemma-4-{12B,31B} configs.

The published checkpoints are multimodal (`gemma4_unified` for the 12B, `gemma4` for the 31B,
text tower under `text_config`); a synthetic one is the text tower alone. Every config field is
set explicitly because transformers' Gemma4TextConfig defaults describe the E2B, not these
sizes. `global_head_dim` and `num_global_key_value_heads` are written as the published files
write them; newer transformers move them into `per_layer_config` when loading.
Dimensions and sources: shared/presets.md.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from models import chat_templates
from models.synth.config_build import DecoderDims, decoder_fields, periodic_layer_types, tiny_dims
from models.synth.family import InitRule, SpecialToken, preset_table, published_preset, tiny_preset
from models.synth.lineages import gemma_family

# Special tokens above Gemma's low five, at their published ids. The turn markers and the tool
# tokens are taken from public copies of the Gemma 4 tokenizer; the multimodal ones from
# transformers' Gemma4Config defaults. Ids past a preset's vocabulary are dropped (the tiny
# preset keeps the low ones).
GEMMA4_PINNED: dict[int, SpecialToken] = {
    46: SpecialToken("<|tool>"),
    47: SpecialToken("<tool|>"),
    50: SpecialToken("<|tool_response>"),
    51: SpecialToken("<tool_response|>"),
    52: SpecialToken('<|"|>'),
    105: SpecialToken("<|turn>"),
    106: SpecialToken("<turn|>"),
    255999: SpecialToken("<|image>"),
    256000: SpecialToken("<|audio>"),
    258880: SpecialToken("<|image|>"),
    258881: SpecialToken("<|audio|>"),
    258882: SpecialToken("<image|>"),
    258883: SpecialToken("<audio|>"),
    258884: SpecialToken("<|video|>"),
}

# Gemma 4's RMSNorm scales by w (not 1 + w): norm weights centre on 1. The per-layer scalar is
# drawn away from 1 so that an engine that forgets it is caught.
#
# Q and K norm weights are the exception. Gemma 4 attends at scale 1, so its trained Q/K norm
# weights carry the 1/sqrt(head_dim) other models put in the scale. At weights near 1, Q·K has a
# standard deviation of sqrt(head_dim) (16 on sliding layers, 22.6 on global ones): softmax is
# nearly an argmax, and bf16 rounding sends the model somewhere else entirely. Seen at the real
# head dims (12 layers, transformers alone, bf16 against fp32 on one 400-token prompt): weights
# near 1 gave hidden states 129 % apart at the last layer and the same top token at 1.3 % of
# positions, so no bf16 engine, transformers included, could pass a parity gate on the 12B preset
# (every stream comparison of the H200 run at 43f10c5 parted at token 0). Weights near
# head_dim^(-1/4) give Q·K a standard deviation near 1: 2.9 % apart, 94 % the same top token.
GEMMA4_INIT_RULES = (
    InitRule("self_attn.q_norm.weight", "head_scaled", 1.0, 0.1),
    InitRule("self_attn.k_norm.weight", "head_scaled", 1.0, 0.1),
    InitRule("norm.weight", "centred", 1.0, 0.1),
    InitRule("layer_scalar", "uniform", 0.5, 1.5),
)


def _fields(
    dims: DecoderDims,
    *,
    num_global_key_value_heads: int,
    global_head_dim: int,
    sliding_window: int,
    global_period: int = 6,
) -> MappingProxyType[str, Any]:
    return decoder_fields(
        dims,
        attention_k_eq_v=True,
        enable_moe_block=False,
        final_logit_softcapping=30.0,
        global_head_dim=global_head_dim,
        hidden_activation="gelu_pytorch_tanh",
        hidden_size_per_layer_input=0,
        # Every `global_period`-th layer is global, and so is the last.
        layer_types=periodic_layer_types(
            dims.num_hidden_layers, global_period, other="sliding_attention", last_full=True
        ),
        moe_intermediate_size=None,
        num_experts=None,
        num_global_key_value_heads=num_global_key_value_heads,
        num_kv_shared_layers=0,
        rope_parameters={
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        sliding_window=sliding_window,
        top_k_experts=None,
        use_bidirectional_attention="vision",
        use_double_wide_mlp=False,
        vocab_size_per_layer_input=dims.vocab_size,
    )


GEMMA4 = gemma_family(
    name="gemma4",
    model_type="gemma4_text",
    architecture="Gemma4ForCausalLM",
    dtype_key="dtype",
    presets=preset_table(
        # 6 layers with the 5:1 pattern shortened to 2:1 (global at 2 and 5), so a global layer
        # sits mid-stack and last; window 12 (not a multiple of a 16-token page); sliding head dim
        # 16, global head dim 32 with one shared K=V head; proportional RoPE rotates 8 of the 32 dims.
        tiny_preset(
            _fields(
                tiny_dims(num_hidden_layers=6, head_dim=16),
                num_global_key_value_heads=1,
                global_head_dim=32,
                sliding_window=12,
                global_period=3,
            )
        ),
        published_preset(
            "12b",
            _fields(
                DecoderDims(
                    vocab_size=262144,
                    hidden_size=3840,
                    intermediate_size=15360,
                    num_hidden_layers=48,
                    num_attention_heads=16,
                    num_key_value_heads=8,
                    head_dim=256,
                    max_position_embeddings=262144,
                ),
                num_global_key_value_heads=1,
                global_head_dim=512,
                sliding_window=1024,
            ),
            "trained",
        ),
        published_preset(
            "31b",
            _fields(
                DecoderDims(
                    vocab_size=262144,
                    hidden_size=5376,
                    intermediate_size=21504,
                    num_hidden_layers=60,
                    num_attention_heads=32,
                    num_key_value_heads=16,
                    head_dim=256,
                    max_position_embeddings=262144,
                ),
                num_global_key_value_heads=4,
                global_head_dim=512,
                sliding_window=1024,
            ),
            "trained",
        ),
    ),
    pinned=GEMMA4_PINNED,
    generation_eos=("<eos>", "<turn|>", "<|tool_response>"),
    chat_template=chat_templates.GEMMA4,
    init_rules=GEMMA4_INIT_RULES,
    generation_defaults=MappingProxyType({"do_sample": True, "temperature": 1.0, "top_k": 64, "top_p": 0.95}),
)
