"""How a Qwen3 config splits over tensor-parallel ranks (engine.parallel.sharding)."""

from __future__ import annotations

from engine.parallel.sharding import DimSplit, GroupedHeads, LayerSplit, ShardPlan
from models.qwen3.config import Qwen3Config


def shard_plan(config: Qwen3Config, ranks: int) -> ShardPlan:
    c = config
    attention = GroupedHeads.of(
        "num_attention_heads", c.num_heads, "num_key_value_heads", c.num_kv_heads, ranks
    )
    mlp = DimSplit.of("intermediate_size", c.intermediate_size, ranks)
    vocab = DimSplit.of("vocab_size", c.vocab_size, ranks)
    layers = tuple(LayerSplit(i, "full_attention", mlp, attention=attention) for i in range(c.num_layers))
    return ShardPlan(ranks, vocab, layers)
