"""The tensors a Gemma 3 text tower must hold, by their Hugging Face names.

A text-only checkpoint names them `model.*`. A multimodal one nests the tower beside its vision
tower and projector, which are skipped and counted: `model.language_model.*` as transformers 5
saves it, `language_model.model.*` as the published Gemma 3 checkpoints store it. Every layer has
Q, K and V projections (no K = V), per-head Q and K norms, and four norms around its two blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from engine.parallel.sharding import ShardPlan
from models.checkpoint import StoredTensor, TensorSlice, TensorSpec, attention_mlp_slices, tower_prefix
from models.gemma3.config import Gemma3Config
from models.paged_line import WeightMap

TEXT_ONLY_PREFIX = "model."
NESTED_PREFIXES = ("model.language_model.", "language_model.model.")
# Where each layout keeps an untied LM head.
_HEADS = {
    TEXT_ONLY_PREFIX: "lm_head.weight",
    "model.language_model.": "lm_head.weight",
    "language_model.model.": "language_model.lm_head.weight",
}
# Top-level parts of a multimodal checkpoint that the text tower does not use.
_SKIPPED_PARTS = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


def text_prefix(names: Iterable[str]) -> str:
    """Where the text tower's tensors live in this checkpoint."""
    return tower_prefix(names, NESTED_PREFIXES, TEXT_ONLY_PREFIX)


def lm_head_name(prefix: str) -> str:
    """The untied LM head's name in the layout whose tower sits under `prefix`."""
    return _HEADS[prefix]


def expected_tensors(config: Gemma3Config, prefix: str) -> dict[str, TensorSpec]:
    c = config
    h = c.hidden_size
    specs: dict[str, TensorSpec] = {
        prefix + "embed_tokens.weight": TensorSpec((c.vocab_size, h)),
        prefix + "norm.weight": TensorSpec((h,)),
    }
    if not c.tie_word_embeddings:
        specs[lm_head_name(prefix)] = TensorSpec((c.vocab_size, h))
    for i in range(c.num_layers):
        p = f"{prefix}layers.{i}."
        specs |= {
            p + "input_layernorm.weight": TensorSpec((h,)),
            p + "post_attention_layernorm.weight": TensorSpec((h,)),
            p + "pre_feedforward_layernorm.weight": TensorSpec((h,)),
            p + "post_feedforward_layernorm.weight": TensorSpec((h,)),
            p + "self_attn.q_proj.weight": TensorSpec((c.q_size, h)),
            p + "self_attn.k_proj.weight": TensorSpec((c.kv_size, h)),
            p + "self_attn.v_proj.weight": TensorSpec((c.kv_size, h)),
            p + "self_attn.o_proj.weight": TensorSpec((h, c.q_size)),
            p + "self_attn.q_norm.weight": TensorSpec((c.head_dim,)),
            p + "self_attn.k_norm.weight": TensorSpec((c.head_dim,)),
            p + "mlp.gate_proj.weight": TensorSpec((c.intermediate_size, h)),
            p + "mlp.up_proj.weight": TensorSpec((c.intermediate_size, h)),
            p + "mlp.down_proj.weight": TensorSpec((h, c.intermediate_size)),
        }
    return specs


def weight_map(config: Gemma3Config, stored: Mapping[str, StoredTensor]) -> WeightMap:
    """The text tower's tensors, under whichever prefix this checkpoint nests them. Vision parts
    are skipped, and so is a stored copy of a tied head."""
    prefix = text_prefix(stored)
    tied_copy = lm_head_name(prefix) if config.tie_word_embeddings else None

    def skipped(name: str) -> bool:
        return name == tied_copy or name.startswith(_SKIPPED_PARTS)

    return WeightMap(expected_tensors(config, prefix), skipped)


def shard_slices(
    config: Gemma3Config, plan: ShardPlan, rank: int, stored: Mapping[str, StoredTensor]
) -> dict[str, TensorSlice]:
    """What rank `rank` reads of each split tensor: Q/K/V and gate/up by output rows (its query and
    KV heads, its MLP columns; a replicated KV head is read by each rank that holds it), O and down
    by input columns, the embedding and an untied LM head by vocabulary rows. Norms whole."""
    prefix = text_prefix(stored)
    vocab = plan.vocab.span(rank)
    slices = {prefix + "embed_tokens.weight": TensorSlice(0, vocab.start, vocab.stop)}
    if not config.tie_word_embeddings:
        slices[lm_head_name(prefix)] = TensorSlice(0, vocab.start, vocab.stop)
    for layer in plan.layers:
        slices |= attention_mlp_slices(f"{prefix}layers.{layer.index}.", layer, rank, config.head_dim)
    return slices
