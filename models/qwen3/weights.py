"""The tensors a Qwen3 checkpoint must hold, by their Hugging Face names."""

from __future__ import annotations

from collections.abc import Mapping

from engine.parallel.sharding import ShardPlan
from models.checkpoint import StoredTensor, TensorSlice, TensorSpec, attention_mlp_slices
from models.paged_line import WeightMap
from models.qwen3.config import Qwen3Config


def expected_tensors(config: Qwen3Config) -> dict[str, TensorSpec]:
    c = config
    specs: dict[str, TensorSpec] = {
        "model.embed_tokens.weight": TensorSpec((c.vocab_size, c.hidden_size)),
        "model.norm.weight": TensorSpec((c.hidden_size,)),
    }
    if not c.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec((c.vocab_size, c.hidden_size))
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        specs |= {
            p + "input_layernorm.weight": TensorSpec((c.hidden_size,)),
            p + "post_attention_layernorm.weight": TensorSpec((c.hidden_size,)),
            p + "self_attn.q_proj.weight": TensorSpec((c.q_size, c.hidden_size)),
            p + "self_attn.k_proj.weight": TensorSpec((c.kv_size, c.hidden_size)),
            p + "self_attn.v_proj.weight": TensorSpec((c.kv_size, c.hidden_size)),
            p + "self_attn.o_proj.weight": TensorSpec((c.hidden_size, c.q_size)),
            p + "self_attn.q_norm.weight": TensorSpec((c.head_dim,)),
            p + "self_attn.k_norm.weight": TensorSpec((c.head_dim,)),
            p + "mlp.gate_proj.weight": TensorSpec((c.intermediate_size, c.hidden_size)),
            p + "mlp.up_proj.weight": TensorSpec((c.intermediate_size, c.hidden_size)),
            p + "mlp.down_proj.weight": TensorSpec((c.hidden_size, c.intermediate_size)),
        }
    return specs


def ignored_tensor(name: str) -> bool:
    """Tensors a tied checkpoint may still carry; everything else unexpected is a fault."""
    return name == "lm_head.weight"


def weight_map(config: Qwen3Config, stored: Mapping[str, StoredTensor]) -> WeightMap:
    return WeightMap(expected_tensors(config), ignored_tensor)


def shard_slices(
    config: Qwen3Config, plan: ShardPlan, rank: int, stored: Mapping[str, StoredTensor]
) -> dict[str, TensorSlice]:
    """What rank `rank` reads of each split tensor: Q/K/V and gate/up by output rows (its heads,
    its MLP columns), O and down by input columns, the embedding and LM head by vocabulary rows.
    Norms are read whole."""
    c = config
    vocab = plan.vocab.span(rank)
    slices = {"model.embed_tokens.weight": TensorSlice(0, vocab.start, vocab.stop)}
    if not c.tie_word_embeddings:
        slices["lm_head.weight"] = TensorSlice(0, vocab.start, vocab.stop)
    for layer in plan.layers:
        slices |= attention_mlp_slices(f"model.layers.{layer.index}.", layer, rank, c.head_dim)
    return slices
