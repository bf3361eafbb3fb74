"""The Gemma 4 text-tower forward over paged KV, written against kernels/ ops.

Embedding × √hidden (the scale rounded to the weight dtype first). Per layer: RMSNorm → Q/K(/V)
projection → attention prep (Q and K RMSNorm with weight `w`, V RMSNorm without; sliding layers
rotate every dim, global layers use proportional rotary and take V from the raw K projection) →
paged attention with scale 1.0 (sliding layers see the last W positions, their own included) → O
projection → RMSNorm → residual add; RMSNorm → gelu_tanh(gate)·up → down → RMSNorm → residual add;
then the layer's scalar. Final RMSNorm, tied LM head, logits soft-capped `c·tanh(x/c)`.

The layer around attention is the step Gemma 3 shares (`models.gemma_layer`): each residual step
one `layer_ops.add_rms_norm` (one launch on CUDA), the post-attention norm of the delta, the add and
the pre-feedforward norm; the post-feedforward norm of the delta, the add, the layer scalar and the
next layer's input norm (the final norm after the last layer). Two KV groups, each with its own pool
and page count: the sliding layers', and the global layers'.

The numeric policy arrives as the injected `linear` (docs/numerics.md), which every projection and
the LM head are called through as `Projections` (`kernels.gemm.projections`): with
`--decode-fusion`, a step the projections fuse (`fuses`: at most 64 rows, `tuned`, CUDA) runs QKV, O,
down and the LM head as the fused GEMV's plain variant and gate/up with its GELU-tanh epilogue
(docs/kernels.md "The fused decode GEMV"); other steps compose, the same ops as without the flag.

Under tensor parallelism (`plan` over `group`'s ranks; docs/tensor-parallel.md) each rank holds its
query heads and its KV heads per layer kind (the global layers' few KV heads replicated once the
ranks outnumber them), its MLP columns, and its vocabulary rows of the tied embedding; O and down
are row-parallel with one all-reduce each, before the norms that read their sums. The soft cap is
elementwise, so it runs on each rank's slice of the logits; the suppressed ids are filled on
rank 0, after the gather.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch, RooflineFacts
from engine.kv.pools import KVGroupShape, KVPools
from engine.parallel.group import ROOT, SINGLE_RANK, RankGroup
from engine.parallel.ops import vocab_parallel_embedding
from engine.parallel.sharding import ShardPlan
from kernels import layer_ops, reference
from kernels.attention.base import AttentionLayerSpec
from kernels.gemm.dispatch import Linear
from kernels.gemm.projections import as_projections
from kernels.prep_dispatch import run_attention_prep
from kernels.reference import NormSpec, NormWeight, PrepSpec
from models.gemma4.config import GLOBAL, SLIDING, Gemma4Config
from models.gemma4.sharding import shard_plan
from models.gemma4.weights import text_prefix
from models.gemma_layer import gemma_layer

# The KV groups, in the order the model declares them: one per attention family.
GROUP_KINDS = (SLIDING, GLOBAL)


@dataclass(slots=True)
class _Layer:
    kind: str
    group: int
    slot: int  # this layer's index inside its group's pool
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    scalar: torch.Tensor
    qkv: torch.Tensor  # [q + k (+ v on sliding layers), hidden]
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class Gemma4Model:
    # Nothing but attention is planned on the host, so prefill graphs may cut the forward there
    # (engine/prefill_graphs.py).
    segmented_capture = True

    def __init__(
        self,
        config: Gemma4Config,
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
        self.vocab = plan.vocab.span(group.rank)
        # This rank's query and KV heads per layer kind (every layer of a kind splits alike).
        self.heads: dict[str, tuple[int, int]] = {}
        for layer_split in plan.layers:
            assert layer_split.attention is not None
            self.heads[layer_split.kind] = (
                layer_split.attention.heads.per_rank,
                layer_split.attention.shared.per_rank,
            )
        prefix = text_prefix(weights)
        self.embed = weights[prefix + "embed_tokens.weight"]
        self.dtype = self.embed.dtype
        # √hidden is stored in the weight dtype before it multiplies (bf16: √3840 → 62.0).
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=torch.float32).to(self.dtype).to(device)
        self.final_norm = weights[prefix + "norm.weight"]
        self.norm = NormSpec(NormWeight.W, eps=c.rms_norm_eps)
        self.preps: dict[str, PrepSpec] = {
            SLIDING: reference.gemma4_sliding_prep(c.sliding.head_dim, c.sliding.rope_theta, c.rms_norm_eps),
            GLOBAL: reference.gemma4_global_prep(
                c.full.head_dim, c.full.rope_theta, c.full.partial_rotary_factor, c.rms_norm_eps
            ),
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
                        num_heads=self.heads[kind][0],
                        num_kv_heads=self.heads[kind][1],
                        head_dim=c.geometry(kind).head_dim,
                        scale=1.0,
                        window=c.sliding_window if kind == SLIDING else None,
                    ),
                    len(c.layers_of(kind)),
                )
                for kind in GROUP_KINDS
            ],
            self.dtype,
            device,
        )
        slots = {kind: 0 for kind in GROUP_KINDS}
        self.layers: list[_Layer] = []
        for i, kind in enumerate(c.layer_types):
            self.layers.append(self._layer(weights, f"{prefix}layers.{i}.", kind, slots[kind]))
            slots[kind] += 1
        self.suppress = (
            torch.tensor(sorted(c.suppress_token_ids), dtype=torch.long, device=device)
            if c.suppress_token_ids
            else None
        )
        # Diagnostics for the layer-probe gate: layer indices whose output hidden states to keep.
        self.probe_layers: frozenset[int] = frozenset()
        self.probes: dict[int, torch.Tensor] = {}

    def _layer(self, w: Mapping[str, torch.Tensor], p: str, kind: str, slot: int) -> _Layer:
        names = ("q", "k", "v") if kind == SLIDING else ("q", "k")
        return _Layer(
            kind=kind,
            group=GROUP_KINDS.index(kind),
            slot=slot,
            input_norm=w[p + "input_layernorm.weight"],
            post_attention_norm=w[p + "post_attention_layernorm.weight"],
            pre_feedforward_norm=w[p + "pre_feedforward_layernorm.weight"],
            post_feedforward_norm=w[p + "post_feedforward_layernorm.weight"],
            scalar=w[p + "layer_scalar"],
            qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in names]),
            o=w[p + "self_attn.o_proj.weight"],
            q_norm=w[p + "self_attn.q_norm.weight"],
            k_norm=w[p + "self_attn.k_norm.weight"],
            gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            down=w[p + "mlp.down_proj.weight"],
        )

    def roofline(self) -> RooflineFacts:
        c = self.config
        matmul_params = c.vocab_size * c.hidden_size
        kv_elements = 0
        attention_flops = 0
        for kind in c.layer_types:
            g = c.geometry(kind)
            q_size, kv_size = c.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
            projections = 3 if kind == SLIDING else 2
            matmul_params += c.hidden_size * (q_size + (projections - 1) * kv_size) + q_size * c.hidden_size
            matmul_params += 3 * c.hidden_size * c.intermediate_size
            kv_elements += 2 * kv_size
            attention_flops += 4 * c.num_heads * g.head_dim
        element = self.embed.element_size()
        return RooflineFacts(
            weight_bytes=matmul_params * element,
            matmul_params=matmul_params,
            kv_bytes_per_token=kv_elements * element,
            attention_flops_per_pair=attention_flops,
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
                scale=layer.scalar,
                reduce=self.group.all_reduce,
            )
            if index in self.probe_layers:
                self.probes[index] = hidden.clone()
        return x.index_select(0, batch.sample_index)

    def _attend(self, layer: _Layer, batch: ForwardBatch, projected: torch.Tensor) -> torch.Tensor:
        """Attention prep and attention of one layer over its QKV projection (K only on global
        layers, whose V is the raw K): [tokens, q_size]."""
        g = self.config.geometry(layer.kind)
        tokens = projected.shape[0]
        num_heads, num_kv_heads = self.heads[layer.kind]
        q_size, kv_size = num_heads * g.head_dim, num_kv_heads * g.head_dim
        if layer.kind == SLIDING:
            q, k, v = projected.split([q_size, kv_size, kv_size], dim=-1)
            v_heads: torch.Tensor | None = v.reshape(tokens, num_kv_heads, g.head_dim)
        else:
            q, k = projected.split([q_size, kv_size], dim=-1)
            v_heads = None
        pool_layer = self.kv.layer(layer.group, layer.slot)
        q_rot, _ = run_attention_prep(
            self.preps[layer.kind],
            q.reshape(tokens, num_heads, g.head_dim),
            k.reshape(tokens, num_kv_heads, g.head_dim),
            v_heads,
            layer.q_norm,
            layer.k_norm,
            batch.rows[layer.group],
            self.rope_tables[layer.kind],
            pool_layer,
        )
        spec = self.kv.shapes[layer.group].attention
        return batch.attention.run(layer.group, spec, q_rot, pool_layer).reshape(tokens, q_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.projections(hidden, self.embed)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            # In the serving dtype, step by step, as the reference rounds it.
            logits = torch.tanh(logits / cap) * cap
        # Rank 0 gets every rank's columns in vocabulary order; the others an empty [rows, 0].
        logits = self.group.gather_columns(logits).float()
        if self.suppress is not None and self.group.rank == ROOT:
            logits = logits.index_fill(-1, self.suppress, float("-inf"))
        return logits
