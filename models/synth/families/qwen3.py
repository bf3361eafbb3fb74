"""Qwen3 dense (model type `qwen3`): presets from the published Qwen/Qwen3-{0.6B,4B,8B} configs.

Dimensions and their sources: shared/presets.md. The config body is spelled as those files are
(transformers 4.51: `rope_theta` + `rope_scaling`, `torch_dtype`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from models import chat_templates
from models.synth.config_build import DecoderDims, decoder_fields, tiny_dims
from models.synth.family import InitRule, SpecialToken, preset_table, published_preset, tiny_preset
from models.synth.lineages import qwen_family

# The Qwen2/Qwen3 pre-tokenizer split.
QWEN3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _control(content: str) -> SpecialToken:
    return SpecialToken(content, special=True)


def _text(content: str) -> SpecialToken:
    return SpecialToken(content, special=False)


# Qwen3's added tokens, in id order from 151643.
QWEN3_SPECIALS: tuple[SpecialToken, ...] = (
    _control("<|endoftext|>"),
    _control("<|im_start|>"),
    _control("<|im_end|>"),
    _control("<|object_ref_start|>"),
    _control("<|object_ref_end|>"),
    _control("<|box_start|>"),
    _control("<|box_end|>"),
    _control("<|quad_start|>"),
    _control("<|quad_end|>"),
    _control("<|vision_start|>"),
    _control("<|vision_end|>"),
    _control("<|vision_pad|>"),
    _control("<|image_pad|>"),
    _control("<|video_pad|>"),
    _text("<tool_call>"),
    _text("</tool_call>"),
    _text("<|fim_prefix|>"),
    _text("<|fim_middle|>"),
    _text("<|fim_suffix|>"),
    _text("<|fim_pad|>"),
    _text("<|repo_name|>"),
    _text("<|file_sep|>"),
    _text("<tool_response>"),
    _text("</tool_response>"),
    _text("<think>"),
    _text("</think>"),
)

# Plain RMSNorm (x * w): every norm weight centres on 1.
QWEN3_INIT_RULES = (InitRule("norm.weight", "centred", 1.0, 0.1),)


def _fields(dims: DecoderDims) -> MappingProxyType[str, Any]:
    return decoder_fields(
        dims,
        hidden_act="silu",
        max_window_layers=dims.num_hidden_layers,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=None,
        use_sliding_window=False,
    )


def _published(
    *, hidden_size: int, intermediate_size: int, num_hidden_layers: int, num_attention_heads: int, tied: bool
) -> MappingProxyType[str, Any]:
    # The published sizes share the vocabulary, 8 KV heads of dim 128 and a 40960-token context.
    return _fields(
        DecoderDims(
            vocab_size=151936,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            tie_word_embeddings=tied,
        )
    )


QWEN3 = qwen_family(
    name="qwen3",
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    dtype_key="torch_dtype",
    presets=preset_table(
        # 4 layers, GQA 4:2, head_dim 32 with 4·32 ≠ 64 (as the 0.6B's 16·128 ≠ 1024), untied head
        # (as the 8B) so the lm_head tensor is exercised.
        tiny_preset(_fields(tiny_dims(num_hidden_layers=4, head_dim=32, tie_word_embeddings=False))),
        published_preset(
            "0.6b",
            _published(
                hidden_size=1024,
                intermediate_size=3072,
                num_hidden_layers=28,
                num_attention_heads=16,
                tied=True,
            ),
            "real",
        ),
        published_preset(
            "4b",
            _published(
                hidden_size=2560,
                intermediate_size=9728,
                num_hidden_layers=36,
                num_attention_heads=32,
                tied=True,
            ),
            "real",
        ),
        published_preset(
            "8b",
            _published(
                hidden_size=4096,
                intermediate_size=12288,
                num_hidden_layers=36,
                num_attention_heads=32,
                tied=False,
            ),
            "real",
        ),
    ),
    appended=QWEN3_SPECIALS,
    config_eos="<|im_end|>",
    split_pattern=QWEN3_SPLIT,
    chat_template=chat_templates.CHATML,
    tokenizer_class="Qwen2Tokenizer",
    init_rules=QWEN3_INIT_RULES,
    generation_defaults=MappingProxyType({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}),
    vocab_resource="resources/qwen.tiktoken",
    padded_vocab_size=151936,
)
