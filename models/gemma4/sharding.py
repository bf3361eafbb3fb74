"""How a Gemma 4 config splits over tensor-parallel ranks (engine.parallel.sharding). Sliding and
global layers have their own KV head counts; the global layers' few (1 on the 12B, 4 on the 31B)
are replicated once the ranks outnumber them."""

from __future__ import annotations

from engine.parallel.sharding import DimSplit, GroupedHeads, LayerSplit, ShardPlan
from models.gemma4.config import GLOBAL, Gemma4Config


def shard_plan(config: Gemma4Config, ranks: int) -> ShardPlan:
    c = config
    sliding = GroupedHeads.of(
        "num_attention_heads", c.num_heads, "num_key_value_heads", c.sliding.num_kv_heads, ranks
    )
    full = GroupedHeads.of(
        "num_attention_heads", c.num_heads, "num_global_key_value_heads", c.full.num_kv_heads, ranks
    )
    mlp = DimSplit.of("intermediate_size", c.intermediate_size, ranks)
    vocab = DimSplit.of("vocab_size", c.vocab_size, ranks)
    layers = tuple(
        LayerSplit(i, kind, mlp, attention=full if kind == GLOBAL else sliding)
        for i, kind in enumerate(c.layer_types)
    )
    return ShardPlan(ranks, vocab, layers)
