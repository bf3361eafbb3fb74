"""How a Gemma 3 config splits over tensor-parallel ranks (engine.parallel.sharding): sliding and
global layers share one head geometry."""

from __future__ import annotations

from engine.parallel.sharding import DimSplit, GroupedHeads, LayerSplit, ShardPlan
from models.gemma3.config import Gemma3Config


def shard_plan(config: Gemma3Config, ranks: int) -> ShardPlan:
    c = config
    attention = GroupedHeads.of(
        "num_attention_heads", c.num_heads, "num_key_value_heads", c.num_kv_heads, ranks
    )
    mlp = DimSplit.of("intermediate_size", c.intermediate_size, ranks)
    vocab = DimSplit.of("vocab_size", c.vocab_size, ranks)
    layers = tuple(LayerSplit(i, kind, mlp, attention=attention) for i, kind in enumerate(c.layer_types))
    return ShardPlan(ranks, vocab, layers)
