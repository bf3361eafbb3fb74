"""How a Qwen3.5 config splits over tensor-parallel ranks (engine.parallel.sharding). Full-attention
layers split by query head over KV heads; Gated DeltaNet layers by value head, each rank keeping the
key heads its value heads read (cut, or replicated when the ranks outnumber them)."""

from __future__ import annotations

from engine.parallel.sharding import DimSplit, GroupedHeads, LayerSplit, ShardPlan
from models.qwen35.config import FULL, Qwen35Config


def shard_plan(config: Qwen35Config, ranks: int) -> ShardPlan:
    c = config
    attention = GroupedHeads.of(
        "num_attention_heads", c.num_heads, "num_key_value_heads", c.num_kv_heads, ranks
    )
    gdn = GroupedHeads.of(
        "linear_num_value_heads",
        c.gdn.num_value_heads,
        "linear_num_key_heads",
        c.gdn.num_key_heads,
        ranks,
    )
    mlp = DimSplit.of("intermediate_size", c.intermediate_size, ranks)
    vocab = DimSplit.of("vocab_size", c.vocab_size, ranks)
    layers = tuple(
        LayerSplit(i, kind, mlp, attention=attention) if kind == FULL else LayerSplit(i, kind, mlp, gdn=gdn)
        for i, kind in enumerate(c.layer_types)
    )
    return ShardPlan(ranks, vocab, layers)
