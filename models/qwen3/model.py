"""The Qwen3 dense forward over paged KV, written against kernels/ ops.

Per layer: RMSNorm → fused QKV projection → attention prep (per-head Q/K RMSNorm with weight `w`,
full RoPE, K and V written to the pool) → paged attention → O projection → residual; RMSNorm →
SwiGLU MLP (fused gate/up) → residual. Final RMSNorm, tied or untied LM head.

The numeric policy arrives as the injected `linear` (docs/numerics.md), a plain linear or a
`kernels.gemm.projections.Projections`. Each residual add goes with the norm that reads its sum
(`layer_ops.add_rms_norm`, one launch on CUDA): the MLP's add with the next layer's input norm, the
last layer's with the final norm. One KV group.

Decode fusion (`--decode-fusion`, docs/kernels.md "The fused decode GEMV"): on a step the projections
fuse (`Projections.fuses`: at most 64 rows, `tuned`, CUDA), a layer is six launches instead: norm + QKV,
attention prep, attention, O + residual, norm + gate/up + SiLU·mul, down + residual; then the final
norm, and the LM head as the plain fused GEMV (on every step it goes through the projections).

Under tensor parallelism (`plan` over `group`'s ranks; docs/tensor-parallel.md) the weights are
this rank's slices: its query and KV heads (column-parallel QKV), its MLP columns (column-parallel
gate/up), the matching input columns of O and down (row-parallel: one all-reduce each), its
vocabulary rows of the embedding and LM head. At one rank every collective is the identity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch, RooflineFacts
from engine.kv.pools import KVGroupShape, KVPools
from engine.parallel.group import SINGLE_RANK, RankGroup
from engine.parallel.ops import vocab_parallel_embedding, vocab_parallel_logits
from engine.parallel.sharding import ShardPlan
from kernels import layer_ops, reference
from kernels.attention.base import AttentionLayerSpec
from kernels.gemm.dispatch import Linear
from kernels.gemm.projections import as_projections
from kernels.prep_dispatch import run_attention_prep
from kernels.reference import GatedActivation, NormSpec, NormWeight
from models.qwen3.config import Qwen3Config
from models.qwen3.sharding import shard_plan


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: torch.Tensor  # [q + k + v, hidden]
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class Qwen3Model:
    # Nothing but attention is planned on the host, so prefill graphs may cut the forward there
    # (engine/prefill_graphs.py).
    segmented_capture = True

    def __init__(
        self,
        config: Qwen3Config,
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
        plan = plan or shard_plan(config, 1)
        if plan.ranks != group.size:
            raise ValueError(f"a plan for {plan.ranks} ranks cannot run on a group of {group.size}")
        attention = plan.layers[0].attention
        assert attention is not None
        self.vocab = plan.vocab.span(group.rank)
        # This rank's heads and the widths of its slices of the fused QKV output.
        self.num_heads = attention.heads.per_rank
        self.num_kv_heads = attention.shared.per_rank
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else weights["lm_head.weight"]
        self.layers = [self._layer(weights, i) for i in range(config.num_layers)]
        self.norm = NormSpec(NormWeight.W, eps=config.rms_norm_eps, round_before_weight=True)
        self.prep = reference.qwen3_prep(config.head_dim, config.rope_theta, config.rms_norm_eps)
        self.rope_table = reference.rope_table(self.prep.rope, max_positions, self.embed.dtype, self.device)
        self.attn_spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=config.head_dim,
            scale=config.head_dim**-0.5,
        )
        self.kv = KVPools(
            [KVGroupShape("full_attention", self.attn_spec, config.num_layers)], self.embed.dtype, device
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
            # QK^T and PV: 2 flops per multiply-add, head_dim each, every query head, every layer.
            attention_flops_per_pair=4 * c.num_layers * c.num_heads * c.head_dim,
        )

    @staticmethod
    def _layer(w: Mapping[str, torch.Tensor], i: int) -> _Layer:
        p = f"model.layers.{i}."
        return _Layer(
            input_norm=w[p + "input_layernorm.weight"],
            post_attention_norm=w[p + "post_attention_layernorm.weight"],
            qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]),
            o=w[p + "self_attn.o_proj.weight"],
            q_norm=w[p + "self_attn.q_norm.weight"],
            k_norm=w[p + "self_attn.k_norm.weight"],
            gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            down=w[p + "mlp.down_proj.weight"],
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = vocab_parallel_embedding(batch.input_ids, self.embed, self.vocab, self.group)
        if self.projections.fuses(hidden.shape[0], hidden.device):
            x = self._fused_layers(hidden, batch)
        else:
            x = self._layers(hidden, batch)
        return x.index_select(0, batch.sample_index)

    def _attend(self, index: int, layer: _Layer, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention prep and attention of one layer over its QKV projection: [tokens, q_size]."""
        tokens, head_dim = qkv.shape[0], self.config.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        pool_layer = self.kv.layer(0, index)
        q_rot, _ = run_attention_prep(
            self.prep,
            q.view(tokens, self.num_heads, head_dim),
            k.view(tokens, self.num_kv_heads, head_dim),
            v.view(tokens, self.num_kv_heads, head_dim),
            layer.q_norm,
            layer.k_norm,
            batch.rows[0],
            self.rope_table,
            pool_layer,
        )
        return batch.attention.run(0, self.attn_spec, q_rot, pool_layer).reshape(tokens, self.q_size)

    def _layers(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every layer as separate projections, each residual add fused with the norm after it; the
        final norm's output of every token."""
        x = layer_ops.rms_norm(hidden, self.norm, self.layers[0].input_norm)
        for index, layer in enumerate(self.layers):
            attn = self._attend(index, layer, self.linear(x, layer.qkv), batch)
            attn_out = self.group.all_reduce(self.linear(attn, layer.o))
            hidden, x = layer_ops.add_rms_norm(hidden, attn_out, self.norm, layer.post_attention_norm)
            activated = self.projections.norm_linear_gated(x, None, None, layer.gate_up, GatedActivation.SILU)
            mlp_out = self.group.all_reduce(self.linear(activated, layer.down))
            # The MLP's add and the norm after it (the next layer's input norm, or the final norm)
            # read the same sum: one step. Norms are per row, so normalising every token and then
            # picking the sampled ones is the same as picking first.
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            hidden, x = layer_ops.add_rms_norm(hidden, mlp_out, self.norm, next_norm)
        return x

    def _fused_layers(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every layer through the fused projections: each norm in the prologue of the projection
        that reads it, each residual add in the epilogue of the projection that makes it."""
        p = self.projections
        reduce = self.group.all_reduce if self.group.size > 1 else None
        for index, layer in enumerate(self.layers):
            qkv = p.norm_linear(hidden, self.norm, layer.input_norm, layer.qkv)
            hidden = p.linear_residual(self._attend(index, layer, qkv, batch), layer.o, hidden, reduce)
            activated = p.norm_linear_gated(
                hidden, self.norm, layer.post_attention_norm, layer.gate_up, GatedActivation.SILU
            )
            hidden = p.linear_residual(activated, layer.down, hidden, reduce)
        return layer_ops.rms_norm(hidden, self.norm, self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the sampling rows; at more than one rank, on rank 0 only (the others get
        an empty [rows, 0])."""
        return vocab_parallel_logits(hidden, self.lm_head, self.group, self.projections)
