"""The tensors a Qwen3.5 text tower must hold, by their Hugging Face names.

A text-only checkpoint names them `model.*`; a `qwen3_5` one nests the tower under
`model.language_model.*` beside the vision tower (`model.visual.*`) and the multi-token-prediction
head (`mtp.*`), which are skipped and counted. `A_log` and the gated norm's weight are loaded in
fp32 whatever the serving dtype (the checkpoints store them so). The LM head is untied exactly
when the checkpoint stores `lm_head.weight`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch

from engine.parallel.sharding import ShardPlan
from models.checkpoint import (
    JoinedSlices,
    StoredTensor,
    TensorPart,
    TensorSlice,
    TensorSpec,
    attention_mlp_slices,
    mlp_slices,
)
from models.paged_line import WeightMap
from models.qwen35.config import LINEAR, Qwen35Config

log = logging.getLogger("infer.models")

TEXT_ONLY_PREFIX = "model."
NESTED_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"
SKIPPED_PARTS = {"vision tower": "model.visual.", "MTP head": "mtp."}


def text_prefix(config: Qwen35Config) -> str:
    return NESTED_PREFIX if config.nested else TEXT_ONLY_PREFIX


def untied(stored: Iterable[str]) -> bool:
    return LM_HEAD in set(stored)


def expected_tensors(config: Qwen35Config, prefix: str, with_lm_head: bool) -> dict[str, TensorSpec]:
    c, h, gdn = config, config.hidden_size, config.gdn
    fp32 = torch.float32
    specs: dict[str, TensorSpec] = {
        prefix + "embed_tokens.weight": TensorSpec((c.vocab_size, h)),
        prefix + "norm.weight": TensorSpec((h,)),
    }
    if with_lm_head:
        specs[LM_HEAD] = TensorSpec((c.vocab_size, h))
    for i, kind in enumerate(c.layer_types):
        p = f"{prefix}layers.{i}."
        specs |= {
            p + "input_layernorm.weight": TensorSpec((h,)),
            p + "post_attention_layernorm.weight": TensorSpec((h,)),
            p + "mlp.gate_proj.weight": TensorSpec((c.intermediate_size, h)),
            p + "mlp.up_proj.weight": TensorSpec((c.intermediate_size, h)),
            p + "mlp.down_proj.weight": TensorSpec((h, c.intermediate_size)),
        }
        if kind == LINEAR:
            a = p + "linear_attn."
            specs |= {
                a + "in_proj_qkv.weight": TensorSpec((gdn.conv_dim, h)),
                a + "in_proj_z.weight": TensorSpec((gdn.value_dim, h)),
                a + "in_proj_b.weight": TensorSpec((gdn.num_value_heads, h)),
                a + "in_proj_a.weight": TensorSpec((gdn.num_value_heads, h)),
                a + "conv1d.weight": TensorSpec((gdn.conv_dim, 1, gdn.conv_kernel)),
                a + "dt_bias": TensorSpec((gdn.num_value_heads,)),
                a + "A_log": TensorSpec((gdn.num_value_heads,), load_dtype=fp32),
                a + "norm.weight": TensorSpec((gdn.value_head_dim,), load_dtype=fp32),
                a + "out_proj.weight": TensorSpec((h, gdn.value_dim)),
            }
        else:
            s = p + "self_attn."
            specs |= {
                # [q | gate] per head: twice the query width.
                s + "q_proj.weight": TensorSpec((2 * c.q_size, h)),
                s + "k_proj.weight": TensorSpec((c.kv_size, h)),
                s + "v_proj.weight": TensorSpec((c.kv_size, h)),
                s + "o_proj.weight": TensorSpec((h, c.q_size)),
                s + "q_norm.weight": TensorSpec((c.head_dim,)),
                s + "k_norm.weight": TensorSpec((c.head_dim,)),
            }
    return specs


def skipped_part(name: str) -> str | None:
    """Which unserved part a stored tensor belongs to, if any."""
    for part, prefix in SKIPPED_PARTS.items():
        if name.startswith(prefix):
            return part
    return None


def weight_map(config: Qwen35Config, stored: Mapping[str, StoredTensor]) -> WeightMap:
    counts: dict[str, int] = {}
    for name in stored:
        part = skipped_part(name)
        if part is not None:
            counts[part] = counts.get(part, 0) + 1
    if counts:
        log.info("qwen3.5: skipping %s", ", ".join(f"{n} {part} tensors" for part, n in counts.items()))
    with_head = untied(stored)
    log.info(
        "qwen3.5: LM head %s", "untied (lm_head.weight stored)" if with_head else "tied to the embedding"
    )
    return WeightMap(
        expected_tensors(config, text_prefix(config), with_head), lambda n: skipped_part(n) is not None
    )


def shard_slices(
    config: Qwen35Config, plan: ShardPlan, rank: int, stored: Mapping[str, StoredTensor]
) -> dict[str, TensorPart]:
    """What rank `rank` reads of each split tensor (docs/tensor-parallel.md). Full-attention layers
    as the dense lines, except that `q_proj` holds `[q | gate]` per head, so a head is 2·head_dim
    rows. Gated DeltaNet layers by value head: `in_proj_qkv` and the conv's channels are q | k | v,
    each section cut to this rank's key heads (q, k) or value heads (v) and joined; z, b, a,
    `dt_bias` and `A_log` by value head; `out_proj` by its value-head input columns. The gated
    norm's weight (one per head dim, shared by every head) and the other norms are read whole."""
    c, g = config, config.gdn
    prefix = text_prefix(config)
    vocab = plan.vocab.span(rank)
    slices: dict[str, TensorPart] = {prefix + "embed_tokens.weight": TensorSlice(0, vocab.start, vocab.stop)}
    if untied(stored):
        slices[LM_HEAD] = TensorSlice(0, vocab.start, vocab.stop)
    for layer in plan.layers:
        p = f"{prefix}layers.{layer.index}."
        if layer.gdn is None:
            assert layer.attention is not None
            heads = layer.attention.heads.span(rank)
            slices |= attention_mlp_slices(p, layer, rank, c.head_dim)
            slices[p + "self_attn.q_proj.weight"] = TensorSlice(
                0, heads.start * 2 * c.head_dim, heads.stop * 2 * c.head_dim
            )
            continue
        values, keys = layer.gdn.heads.span(rank), layer.gdn.shared.span(rank)
        K, V = g.key_head_dim, g.value_head_dim
        q_rows = TensorSlice(0, keys.start * K, keys.stop * K)
        k_rows = TensorSlice(0, g.key_dim + keys.start * K, g.key_dim + keys.stop * K)
        v_rows = TensorSlice(0, 2 * g.key_dim + values.start * V, 2 * g.key_dim + values.stop * V)
        qkv = JoinedSlices((q_rows, k_rows, v_rows))
        a = p + "linear_attn."
        slices |= {
            a + "in_proj_qkv.weight": qkv,
            a + "conv1d.weight": qkv,
            a + "in_proj_z.weight": TensorSlice(0, values.start * V, values.stop * V),
            a + "in_proj_b.weight": TensorSlice(0, values.start, values.stop),
            a + "in_proj_a.weight": TensorSlice(0, values.start, values.stop),
            a + "dt_bias": TensorSlice(0, values.start, values.stop),
            a + "A_log": TensorSlice(0, values.start, values.stop),
            a + "out_proj.weight": TensorSlice(1, values.start * V, values.stop * V),
            **mlp_slices(p, layer, rank),
        }
    return slices
