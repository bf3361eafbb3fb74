"""The Gemma 3 text-tower forward over paged KV, written against kernels/ ops.

Embedding × √hidden (the scale rounded to the weight dtype first). Per layer: RMSNorm → Q/K/V
projection → attention prep (Q and K RMSNorm with weight `1+w`, full rotary at the layer kind's
base with its frequencies divided by the kind's linear factor where set, V as projected) → paged
attention at scale `query_pre_attn_scalar^-½` (sliding layers see the last W positions, their own
included) → O projection → RMSNorm → residual add; RMSNorm → gelu_tanh(gate)·up → down → RMSNorm →
residual add. Final RMSNorm, tied (or stored) LM head, logits soft-capped `c·tanh(x/c)` where the
config sets a cap. Every RMSNorm multiplies by `1+w`.

The layer around attention is the step Gemma 4 shares (`models.gemma_layer`), without a layer
scalar: each residual step one `layer_ops.add_rms_norm` (one launch on CUDA), the post-attention
norm of the delta, the add and the pre-feedforward norm; the post-feedforward norm of the delta, the
add and the next layer's input norm (the final norm after the last layer). One KV group per layer
kind the checkpoint has, each with its own pool: the sliding layers' (its pages released as the
window moves past them) and the global layers'.

The numeric policy arrives as the injected `linear` (docs/numerics.md), which every projection and
the LM head are called through as `Projections` (`kernels.gemm.projections`): with
`--decode-fusion`, a step the projections fuse (`fuses`: at most 64 rows, `tuned`, CUDA) runs QKV, O,
down and the LM head as the fused GEMV's plain variant and gate/up with its GELU-tanh epilogue
(docs/kernels.md "The fused decode GEMV"); other steps compose, the same ops as without the flag.

Under tensor parallelism (`plan` over `group`'s ranks; docs/tensor-parallel.md) each rank holds its
query and KV heads (a single KV head, as on the published 270M and 1B, replicated on every rank),
its MLP columns and its vocabulary rows of the embedding and LM head; O and down are row-parallel
with one all-reduce each, before the norms that read their sums; the soft cap runs on each rank's
slice of the logits.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch, RooflineFacts
from engine.kv.pools import KVGroupShape, KVPools
from engine.parallel.group import SINGLE_RANK, RankGroup
from engine.parallel.ops import vocab_parallel_embedding
from engine.parallel.sharding import ShardPlan
from kernels import layer_ops, reference
from kernels.attention.base import AttentionLayerSpec
from kernels.gemm.dispatch import Linear
from kernels.gemm.projections import as_projections
from kernels.prep_dispatch import run_attention_prep
from kernels.reference import NormSpec, NormWeight, PrepSpec
from models.gemma3.config import LAYER_TYPES, SLIDING, Gemma3Config
from models.gemma3.sharding import shard_plan
from models.gemma3.weights import lm_head_name, text_prefix
from models.gemma_layer import gemma_layer


def group_kinds(config: Gemma3Config) -> tuple[str, ...]:
    """The KV groups, in the order the model declares them: sliding first, then global, each only
    where the checkpoint has such layers."""
    return tuple(kind for kind in LAYER_TYPES if kind in config.layer_types)


@dataclass(slots=True)
class _Layer:
    kind: str
    group: int
    slot: int  # this layer's index inside its group's pool
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    qkv: torch.Tensor  # [q + k + v, hidden]
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class Gemma3Model:
    # Nothing but attention is planned on the host, so prefill graphs may cut the forward there
    # (engine/prefill_graphs.py).
    segmented_capture = True

    def __init__(
        self,
        config: Gemma3Config,
        weights: Mapping[str, torch.Tensor],
        device: torch.device,
        max_positions: int,
        linear: Linear = F.linear,
        *,
        plan: ShardPlan | None = None,
        group: RankGroup = SINGLE_RANK,
    ) -> None:
        self.config = config
        self.projections = as_projections(linear)
        self.linear = self.projections.linear  # the policy's own linear
        self.device = device
        self.group = group
        c = config
        plan = plan or shard_plan(config, 1)
        if plan.ranks != group.size:
            raise ValueError(f"a plan for {plan.ranks} ranks cannot run on a group of {group.size}")
        attention = plan.layers[0].attention
        assert attention is not None
        self.vocab = plan.vocab.span(group.rank)
        # This rank's heads and the widths of its slices of the fused QKV output.
        self.num_heads = attention.heads.per_rank
        self.num_kv_heads = attention.shared.per_rank
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim
        prefix = text_prefix(weights)
        self.embed = weights[prefix + "embed_tokens.weight"]
        self.dtype = self.embed.dtype
        self.lm_head = self.embed if c.tie_word_embeddings else weights[lm_head_name(prefix)]
        self.embed_scale = reference.embedding_scale(c.hidden_size, self.dtype, device)
        self.final_norm = weights[prefix + "norm.weight"]
        self.norm = NormSpec(NormWeight.ONE_PLUS_W, eps=c.rms_norm_eps)
        self.group_kinds = group_kinds(c)
        self.preps: dict[str, PrepSpec] = {
            kind: reference.gemma3_prep(
                c.head_dim, c.rope(kind).theta, c.rms_norm_eps, linear_factor=c.rope(kind).linear_factor
            )
            for kind in self.group_kinds
        }
        self.rope_tables = {
            kind: reference.rope_table(prep.rope, max_positions, self.dtype, device)
            for kind, prep in self.preps.items()
        }
        self.kv = KVPools(
            [
                KVGroupShape(
                    kind,
                    AttentionLayerSpec(
                        num_heads=self.num_heads,
                        num_kv_heads=self.num_kv_heads,
                        head_dim=c.head_dim,
                        scale=c.attention_scale,
                        window=c.sliding_window if kind == SLIDING else None,
                    ),
                    len(c.layers_of(kind)),
                )
                for kind in self.group_kinds
            ],
            self.dtype,
            device,
        )
        slots = dict.fromkeys(self.group_kinds, 0)
        self.layers: list[_Layer] = []
        for i, kind in enumerate(c.layer_types):
            self.layers.append(self._layer(weights, f"{prefix}layers.{i}.", kind, slots[kind]))
            slots[kind] += 1

    def _layer(self, w: Mapping[str, torch.Tensor], p: str, kind: str, slot: int) -> _Layer:
        return _Layer(
            kind=kind,
            group=self.group_kinds.index(kind),
            slot=slot,
            input_norm=w[p + "input_layernorm.weight"],
            post_attention_norm=w[p + "post_attention_layernorm.weight"],
            pre_feedforward_norm=w[p + "pre_feedforward_layernorm.weight"],
            post_feedforward_norm=w[p + "post_feedforward_layernorm.weight"],
            qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]),
            o=w[p + "self_attn.o_proj.weight"],
            q_norm=w[p + "self_attn.q_norm.weight"],
            k_norm=w[p + "self_attn.k_norm.weight"],
            gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            down=w[p + "mlp.down_proj.weight"],
        )

    def roofline(self) -> RooflineFacts:
        c = self.config
        per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
        per_layer += 3 * c.hidden_size * c.intermediate_size
        matmul_params = c.num_layers * per_layer + c.vocab_size * c.hidden_size
        element = self.embed.element_size()
        return RooflineFacts(
            weight_bytes=matmul_params * element,
            matmul_params=matmul_params,
            kv_bytes_per_token=2 * c.num_layers * c.kv_size * element,
            attention_flops_per_pair=4 * c.num_layers * c.num_heads * c.head_dim,
        )

    # -- forward -------------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = (
            vocab_parallel_embedding(batch.input_ids, self.embed, self.vocab, self.group) * self.embed_scale
        )
        x = layer_ops.rms_norm(hidden, self.norm, self.layers[0].input_norm)
        for index, layer in enumerate(self.layers):
            # Norms are per row: normalising every token with the final norm, then picking the
            # sampled ones, is the same as picking first.
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            hidden, x = gemma_layer(
                self.projections,
                layer,
                hidden,
                x,
                functools.partial(self._attend, layer, batch),
                norm=self.norm,
                next_norm=next_norm,
                scale=None,
                reduce=self.group.all_reduce,
            )
        return x.index_select(0, batch.sample_index)

    def _attend(self, layer: _Layer, batch: ForwardBatch, projected: torch.Tensor) -> torch.Tensor:
        """Attention prep and attention of one layer over its QKV projection: [tokens, q_size]."""
        head_dim, tokens = self.config.head_dim, projected.shape[0]
        q, k, v = projected.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        pool_layer = self.kv.layer(layer.group, layer.slot)
        q_rot, _ = run_attention_prep(
            self.preps[layer.kind],
            q.reshape(tokens, self.num_heads, head_dim),
            k.reshape(tokens, self.num_kv_heads, head_dim),
            v.reshape(tokens, self.num_kv_heads, head_dim),
            layer.q_norm,
            layer.k_norm,
            batch.rows[layer.group],
            self.rope_tables[layer.kind],
            pool_layer,
        )
        spec = self.kv.attention_specs[layer.group]
        return batch.attention.run(layer.group, spec, q_rot, pool_layer).reshape(tokens, self.q_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.projections(hidden, self.lm_head)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            # In the serving dtype, step by step, as the reference rounds it.
            logits = torch.tanh(logits / cap) * cap
        # Rank 0 gets every rank's columns in vocabulary order; the others an empty [rows, 0].
        return self.group.gather_columns(logits).float()
