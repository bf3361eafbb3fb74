"""The tensors a Gemma 4 text tower must hold, by their Hugging Face names.

A text-only checkpoint names them `model.*`; a multimodal one nests the tower under
`model.language_model.*` beside its vision and audio parts, which are skipped and counted. Global
layers have no `v_proj` (V is the raw K projection).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from engine.parallel.sharding import ShardPlan
from models.checkpoint import StoredTensor, TensorSlice, TensorSpec, attention_mlp_slices, tower_prefix
from models.gemma4.config import SLIDING, Gemma4Config
from models.paged_line import WeightMap

TEXT_ONLY_PREFIX = "model."
NESTED_PREFIX = "model.language_model."
# Top-level parts of a multimodal checkpoint that the text tower does not use.
_SKIPPED_PARTS = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
    "model.vision_embedder.",
    "model.audio_embedder.",
)
# A tied head the checkpoint may still store.
_TIED_HEAD = "lm_head.weight"


def text_prefix(names: Iterable[str]) -> str:
    """Where the text tower's tensors live in this checkpoint."""
    return tower_prefix(names, (NESTED_PREFIX,), TEXT_ONLY_PREFIX)


def expected_tensors(config: Gemma4Config, prefix: str) -> dict[str, TensorSpec]:
    c = config
    h = c.hidden_size
    specs: dict[str, TensorSpec] = {
        prefix + "embed_tokens.weight": TensorSpec((c.vocab_size, h)),
        prefix + "norm.weight": TensorSpec((h,)),
    }
    for i, kind in enumerate(c.layer_types):
        g = c.geometry(kind)
        q_size, kv_size = c.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
        p = f"{prefix}layers.{i}."
        specs |= {
            p + "input_layernorm.weight": TensorSpec((h,)),
            p + "post_attention_layernorm.weight": TensorSpec((h,)),
            p + "pre_feedforward_layernorm.weight": TensorSpec((h,)),
            p + "post_feedforward_layernorm.weight": TensorSpec((h,)),
            p + "layer_scalar": TensorSpec((1,)),
            p + "self_attn.q_proj.weight": TensorSpec((q_size, h)),
            p + "self_attn.k_proj.weight": TensorSpec((kv_size, h)),
            p + "self_attn.o_proj.weight": TensorSpec((h, q_size)),
            p + "self_attn.q_norm.weight": TensorSpec((g.head_dim,)),
            p + "self_attn.k_norm.weight": TensorSpec((g.head_dim,)),
            p + "mlp.gate_proj.weight": TensorSpec((c.intermediate_size, h)),
            p + "mlp.up_proj.weight": TensorSpec((c.intermediate_size, h)),
            p + "mlp.down_proj.weight": TensorSpec((h, c.intermediate_size)),
        }
        if kind == SLIDING:
            specs[p + "self_attn.v_proj.weight"] = TensorSpec((kv_size, h))
    return specs


def skipped_tensor(name: str) -> bool:
    """Vision and audio tensors (not served) and a stored copy of the tied head."""
    return name == _TIED_HEAD or name.startswith(_SKIPPED_PARTS)


def weight_map(config: Gemma4Config, stored: Mapping[str, StoredTensor]) -> WeightMap:
    """The text tower's tensors, under whichever prefix this checkpoint nests them."""
    return WeightMap(expected_tensors(config, text_prefix(stored)), skipped_tensor)


def shard_slices(
    config: Gemma4Config, plan: ShardPlan, rank: int, stored: Mapping[str, StoredTensor]
) -> dict[str, TensorSlice]:
    """What rank `rank` reads of each split tensor: Q/K(/V) and gate/up by output rows (its query
    and KV heads, its MLP columns; a replicated KV head is read by each rank that holds it), O and
    down by input columns, the tied embedding by vocabulary rows. Norms and scalars whole."""
    prefix = text_prefix(stored)
    vocab = plan.vocab.span(rank)
    slices = {prefix + "embed_tokens.weight": TensorSlice(0, vocab.start, vocab.stop)}
    for layer in plan.layers:
        head_dim = config.geometry(layer.kind).head_dim
        layer_prefix = f"{prefix}layers.{layer.index}."
        slices |= attention_mlp_slices(layer_prefix, layer, rank, head_dim, with_v=layer.kind == SLIDING)
    return slices
