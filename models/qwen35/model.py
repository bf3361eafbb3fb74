"""The Qwen3.5 forward over paged KV and per-request state slots, written against kernels/ ops.

Every layer: RMSNorm `(1+w)` → token mixer → residual; RMSNorm → SwiGLU MLP → residual. The mixer
is one of two:

- Gated DeltaNet (`linear_attention`): one fused projection to qkv, z, b, a; the causal conv over
  all of qkv with SiLU (its state: the last W − 1 inputs); q, k, v split; `g` and `β` from a, b
  (`reference.gdn_gates`); the gated delta rule over the recurrent state (q and k L2-normed inside,
  more value heads than key heads, never repeated); the gated RMSNorm by z; the output projection.
  Conv and recurrent state live in the model's `StatePools`, addressed by each row's state slot.
  The conv, gates and delta rule (`_gdn_core`) are the layer's one part that reads the step's rows
  on the host: they run behind `ForwardBatch.host_planned`, where prefill graphs cut the forward.
- Gated attention (`full_attention`): q_proj is `[q | gate]` per head; the attention-prep op
  normalises (`1+w`), applies partial RoPE to the leading dims and writes K/V to the one KV group;
  paged attention; the output times `sigmoid(gate)`; the output projection.

Final RMSNorm, then the LM head (tied to the embedding unless the checkpoint stores its own).

Decode fusion (`--decode-fusion`, docs/kernels.md "The fused decode GEMV"): on a step the projections
fuse (`Projections.fuses`: at most 64 rows, `tuned`, CUDA) a layer runs as Qwen3's does: the input norm
in the prologue of the mixer's input projection (GDN's in_proj or attention's QKV), the mixer's
output projection (out_proj or O) with the residual add in its epilogue, norm + gate/up + SiLU·mul,
down + residual; the LM head as the plain fused GEMV. Attention runs as on every step.

The GDN decode mixer: on a step where every row decodes one token, a GDN layer's mixer between
in_proj and out_proj runs as three Triton launches (`kernels.gdn.decode_mixer`: conv step with the
state shift, gates + recurrent step, gated norm) instead of the backend's conv, the torch gates and
the torch gated norm; other steps compose it, their gates and gated norm through the mixer's
token-wise kernels.
It runs on CUDA with either projection path unless `--gdn-backend torch` (the spec's own form) was
asked for, and with `--decode-fusion`.

Under tensor parallelism (`plan` over `group`'s ranks; docs/tensor-parallel.md) the weights are
this rank's slices. Gated attention splits as the dense lines (its query and gate heads, its KV
heads; O row-parallel). Gated DeltaNet splits by value head: the rank's value heads and the key
heads they read (`gdn_geometry`, cut or replicated by the plan) in every projection, the conv's
channels and the state slots; out_proj row-parallel. Each row-parallel projection (O, out_proj,
down) ends in one all-reduce; the embedding and LM head are vocabulary-parallel. At one rank every
collective is the identity.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch, RooflineFacts
from engine.kv.pools import KVGroupShape, KVPools
from engine.kv.state_pool import StatePools, StateShape
from engine.parallel.group import SINGLE_RANK, RankGroup
from engine.parallel.ops import vocab_parallel_embedding, vocab_parallel_logits
from engine.parallel.sharding import GroupedHeads, ShardPlan
from kernels import layer_ops, reference
from kernels.attention.base import AttentionLayerSpec
from kernels.gdn import GDNBackend, StateRows, TorchGDN
from kernels.gemm.dispatch import Linear
from kernels.gemm.projections import as_projections
from kernels.prep_dispatch import run_attention_prep
from kernels.reference import GatedActivation, NormSpec, NormWeight
from kernels.triton.storage import interpreted
from models.qwen35.config import FULL, LINEAR, GDNGeometry, Qwen35Config
from models.qwen35.sharding import shard_plan
from models.qwen35.weights import LM_HEAD, text_prefix

if TYPE_CHECKING:
    from kernels.gdn.decode_mixer import DecodeMixer, MixerWeights


@dataclass(slots=True)
class _DeltaNet:
    state_index: int  # which slice of the state pools
    in_proj: torch.Tensor  # [conv_dim + value_dim + 2·Hv, hidden]: qkv | z | b | a
    conv: torch.Tensor  # [conv_dim, W]
    dt_bias: torch.Tensor
    a_log: torch.Tensor  # fp32
    norm: torch.Tensor  # fp32
    out: torch.Tensor


@dataclass(slots=True)
class _Attention:
    kv_index: int  # which layer of the KV group
    qkv: torch.Tensor  # [2·q + k + v, hidden]
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    mixer: _DeltaNet | _Attention
    gate_up: torch.Tensor
    down: torch.Tensor


class Qwen35Model:
    # Attention and the GDN layers' varlen core (conv + chunked delta rule, planned on the host
    # from the rows) are the only host-planned ops, each behind a cut point
    # (`ForwardBatch.host_planned`), so prefill graphs may cut the forward there.
    segmented_capture = True

    def __init__(
        self,
        config: Qwen35Config,
        weights: Mapping[str, torch.Tensor],
        device: torch.device,
        max_positions: int,
        linear: Linear = F.linear,
        gdn: GDNBackend | None = None,
        *,
        plan: ShardPlan | None = None,
        group: RankGroup = SINGLE_RANK,
    ) -> None:
        self.config = config
        self.projections = as_projections(linear)
        self.linear = self.projections.linear  # the policy's own linear
        self.device = device
        self.gdn = gdn or TorchGDN()
        self.group = group
        plan = plan or shard_plan(config, 1)
        if plan.ranks != group.size:
            raise ValueError(f"a plan for {plan.ranks} ranks cannot run on a group of {group.size}")
        self.vocab = plan.vocab.span(group.rank)
        attention = _split_of(plan, FULL)
        # This rank's heads: the widths of its slices of every projection.
        self.num_heads = config.num_heads if attention is None else attention.heads.per_rank
        self.num_kv_heads = config.num_kv_heads if attention is None else attention.shared.per_rank
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        deltanet = _split_of(plan, LINEAR)
        self.gdn_geometry: GDNGeometry = (
            config.gdn
            if deltanet is None
            else replace(
                config.gdn,
                num_key_heads=deltanet.shared.per_rank,
                num_value_heads=deltanet.heads.per_rank,
            )
        )
        prefix = text_prefix(config)
        self.embed = weights[prefix + "embed_tokens.weight"]
        self.final_norm = weights[prefix + "norm.weight"]
        self.lm_head = weights.get(LM_HEAD, self.embed)
        self.norm = NormSpec(NormWeight.ONE_PLUS_W, eps=config.rms_norm_eps)
        linear_layers, full_layers = config.layers_of(LINEAR), config.layers_of(FULL)
        self.layers = [
            self._layer(weights, prefix, i, linear_layers, full_layers) for i in range(config.num_layers)
        ]
        self.prep = reference.qwen35_full_attention_prep(
            config.head_dim, config.rope_theta, config.partial_rotary_factor, config.rms_norm_eps
        )
        self.rope_table = reference.rope_table(self.prep.rope, max_positions, self.embed.dtype, device)
        self.attn_spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=config.head_dim,
            scale=config.head_dim**-0.5,
        )
        self.kv = KVPools([KVGroupShape(FULL, self.attn_spec, len(full_layers))], self.embed.dtype, device)
        g = self.gdn_geometry
        self.state = StatePools(
            StateShape(
                len(linear_layers),
                conv=(g.conv_kernel - 1, g.conv_dim),
                recurrent=(g.num_value_heads, g.value_head_dim, g.key_head_dim),
            ),
            self.embed.dtype,
            device,
        )
        # The fused GDN decode step runs where its Triton kernels do (CUDA, or the interpreter in
        # tests) with any GDN backend but torch (the spec's own form), and with the fused
        # projections (`--decode-fusion`) whatever the backend. Its weights per GDN layer, in
        # state-index order.
        self.decode_mixer: DecodeMixer | None = None
        self._mixer_weights: list[MixerWeights] = []
        # The last step's rows (`_rows_of`): the batch they were read from, and them.
        self._rows_cache: tuple[ForwardBatch, StateRows] | None = None
        kernels_run = device.type == "cuda" or interpreted()
        if kernels_run and (self.projections.fuses(1, device) or not isinstance(self.gdn, TorchGDN)):
            from kernels.gdn.decode_mixer import DecodeMixer, MixerWeights

            self.decode_mixer = DecodeMixer(g.kernel_geometry(), g.conv_kernel, self.embed.dtype)
            eps = config.rms_norm_eps
            self._mixer_weights = [
                MixerWeights(m.conv, m.a_log, m.dt_bias, m.norm, eps)
                for m in (layer.mixer for layer in self.layers)
                if isinstance(m, _DeltaNet)
            ]

    @staticmethod
    def _layer(
        w: Mapping[str, torch.Tensor], prefix: str, i: int, linear: tuple[int, ...], full: tuple[int, ...]
    ) -> _Layer:
        p = f"{prefix}layers.{i}."
        mixer: _DeltaNet | _Attention
        if i in linear:
            a = p + "linear_attn."
            mixer = _DeltaNet(
                state_index=linear.index(i),
                in_proj=torch.cat([w[a + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")]),
                conv=w[a + "conv1d.weight"].squeeze(1),
                dt_bias=w[a + "dt_bias"],
                a_log=w[a + "A_log"],
                norm=w[a + "norm.weight"],
                out=w[a + "out_proj.weight"],
            )
        else:
            s = p + "self_attn."
            mixer = _Attention(
                kv_index=full.index(i),
                qkv=torch.cat([w[s + f"{n}_proj.weight"] for n in ("q", "k", "v")]),
                o=w[s + "o_proj.weight"],
                q_norm=w[s + "q_norm.weight"],
                k_norm=w[s + "k_norm.weight"],
            )
        return _Layer(
            input_norm=w[p + "input_layernorm.weight"],
            post_attention_norm=w[p + "post_attention_layernorm.weight"],
            mixer=mixer,
            gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            down=w[p + "mlp.down_proj.weight"],
        )

    def roofline(self) -> RooflineFacts:
        c, g = self.config, self.config.gdn
        full, linear = len(c.layers_of(FULL)), len(c.layers_of(LINEAR))
        attention = c.hidden_size * (2 * c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
        deltanet = (
            c.hidden_size * (g.conv_dim + g.value_dim + 2 * g.num_value_heads) + g.value_dim * c.hidden_size
        )
        mlp = 3 * c.hidden_size * c.intermediate_size
        matmul_params = (
            full * attention + linear * deltanet + c.num_layers * mlp + c.vocab_size * c.hidden_size
        )
        element = self.embed.element_size()
        return RooflineFacts(
            weight_bytes=matmul_params * element,
            matmul_params=matmul_params,
            kv_bytes_per_token=2 * full * c.kv_size * element,
            attention_flops_per_pair=4 * full * c.num_heads * c.head_dim,
            state_bytes_per_row=self.state.bytes_per_slot(),
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = vocab_parallel_embedding(batch.input_ids, self.embed, self.vocab, self.group)
        # A step of one token per row reads its rows on the device (a captured decode step); any
        # other step's rows are read by the GDN core, which runs behind `batch.host_planned`.
        rows = self._state_rows(batch) if batch.cu_seqlens is None else None
        # Read afresh each forward: a static batch's buffers hold another step's values each time.
        self._rows_cache = None if rows is None else (batch, rows)
        if self.projections.fuses(hidden.shape[0], hidden.device):
            x = self._fused_layers(hidden, batch, rows)
        else:
            x = self._layers(hidden, batch, rows)
        return x.index_select(0, batch.sample_index)

    def _layers(self, hidden: torch.Tensor, batch: ForwardBatch, rows: StateRows | None) -> torch.Tensor:
        """Every layer as separate projections, each residual add fused with the norm after it; the
        final norm's output of every token."""
        x = layer_ops.rms_norm(hidden, self.norm, self.layers[0].input_norm)
        fused_gdn = self._fused_gdn(rows, hidden.device)
        for index, layer in enumerate(self.layers):
            into, out = _mixer_projections(layer.mixer)
            mixed = self.linear(self._mix(layer.mixer, self.linear(x, into), batch, rows, fused_gdn), out)
            mixed = self.group.all_reduce(mixed)
            hidden, x = layer_ops.add_rms_norm(hidden, mixed, self.norm, layer.post_attention_norm)
            activated = self.projections.norm_linear_gated(x, None, None, layer.gate_up, GatedActivation.SILU)
            mlp_out = self.group.all_reduce(self.linear(activated, layer.down))
            # Norms are per row: the final norm over every token, then the sampled ones, is the
            # same as picking first.
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            hidden, x = layer_ops.add_rms_norm(hidden, mlp_out, self.norm, next_norm)
        return x

    def _fused_layers(
        self, hidden: torch.Tensor, batch: ForwardBatch, rows: StateRows | None
    ) -> torch.Tensor:
        """Every layer through the fused projections: each norm in the prologue of the projection
        that reads it, each residual add in the epilogue of the projection that makes it."""
        p = self.projections
        reduce = self.group.all_reduce if self.group.size > 1 else None
        fused_gdn = self._fused_gdn(rows, hidden.device)
        for layer in self.layers:
            into, out = _mixer_projections(layer.mixer)
            projected = p.norm_linear(hidden, self.norm, layer.input_norm, into)
            mixed = self._mix(layer.mixer, projected, batch, rows, fused_gdn)
            hidden = p.linear_residual(mixed, out, hidden, reduce)
            activated = p.norm_linear_gated(
                hidden, self.norm, layer.post_attention_norm, layer.gate_up, GatedActivation.SILU
            )
            hidden = p.linear_residual(activated, layer.down, hidden, reduce)
        return layer_ops.rms_norm(hidden, self.norm, self.final_norm)

    def _fused_gdn(self, rows: StateRows | None, device: torch.device) -> bool:
        """Whether this step's GDN layers run the fused decode mixer; decided once per step from host
        facts only, so every GDN layer takes the same path."""
        return rows is not None and self.decode_mixer is not None and self.decode_mixer.runs(rows, device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the sampling rows; at more than one rank, on rank 0 only (the others get
        an empty [rows, 0])."""
        return vocab_parallel_logits(hidden, self.lm_head, self.group, self.projections)

    # -- mixers ----------------------------------------------------------------------------------

    def _rows_of(self, batch: ForwardBatch) -> StateRows:
        """`_state_rows(batch)`, made once per forward (or per step of prefill graphs, whose GDN
        cores run on a new live batch each step) whichever GDN layer asks first."""
        cached = self._rows_cache
        if cached is None or cached[0] is not batch:
            cached = self._rows_cache = (batch, self._state_rows(batch))
        return cached[1]

    @staticmethod
    def _state_rows(batch: ForwardBatch) -> StateRows:
        """Each row's slot, and whether its state starts from zero (its first token is at position
        0: a new prompt, or one recomputed after preemption). A step of one token per row needs
        nothing from the host (a graph-captured decode step)."""
        slots = batch.state_slots
        if slots is None:
            raise ValueError("a Qwen3.5 step needs state_slots in its ForwardBatch (engine.step_packer)")
        sequences, tokens = int(slots.shape[0]), batch.num_tokens
        if sequences == tokens:
            return StateRows(slots, batch.positions == 0)
        cu = batch.cu_seqlens
        if cu is None or len(cu) != sequences + 1:
            raise ValueError(
                f"a Qwen3.5 step of {tokens} tokens in {sequences} rows needs the rows' cu_seqlens "
                f"(engine.step_packer), got {cu}"
            )
        starts = torch.tensor(cu[:-1], dtype=torch.long).to(batch.positions.device, non_blocking=True)
        return StateRows(slots, batch.positions.index_select(0, starts) == 0, cu)

    def _mix(
        self,
        mixer: _DeltaNet | _Attention,
        projected: torch.Tensor,
        batch: ForwardBatch,
        rows: StateRows | None,
        fused_gdn: bool = False,
    ) -> torch.Tensor:
        """The token mixer between its two projections: from the input projection's output to the
        output projection's input; ``fused_gdn``: a GDN layer runs the fused decode mixer."""
        if isinstance(mixer, _DeltaNet):
            return self._deltanet(mixer, projected, batch, rows, fused_gdn)
        return self._attention(mixer, projected, batch)

    def _deltanet(
        self,
        layer: _DeltaNet,
        projected: torch.Tensor,
        batch: ForwardBatch,
        rows: StateRows | None,
        fused_gdn: bool = False,
    ) -> torch.Tensor:
        """out_proj's input from in_proj's output: this rank's value heads, [tokens, value_dim]."""
        g = self.gdn_geometry
        tokens = projected.shape[0]
        qkv, z, b, a = self._in_proj_parts(projected)
        if fused_gdn:
            assert self.decode_mixer is not None and rows is not None
            return self.decode_mixer.mix(
                qkv,
                z,
                b,
                a,
                self._mixer_weights[layer.state_index],
                rows,
                self.state.conv_layer(layer.state_index),
                self.state.recurrent_layer(layer.state_index),
            )
        core = batch.host_planned(
            "gdn-core", functools.partial(self._gdn_core, layer), projected, g.value_dim
        ).reshape(tokens, g.num_value_heads, g.value_head_dim)
        gate = z.reshape(tokens, g.num_value_heads, g.value_head_dim)
        eps = self.config.rms_norm_eps
        mixer = self.decode_mixer
        if mixer is not None:
            normed = mixer.gated_norm(core, gate, layer.norm, eps)
        else:
            normed = reference.gated_rms_norm(core, gate, layer.norm, eps)
        return normed.reshape(tokens, g.value_dim)

    def _in_proj_parts(self, projected: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """in_proj's output as column views: qkv (the conv's input), z, b, a."""
        g = self.gdn_geometry
        return projected.split([g.conv_dim, g.value_dim, g.num_value_heads, g.num_value_heads], dim=-1)

    def _gdn_core(self, layer: _DeltaNet, projected: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The conv, gates and delta rule of one GDN layer over its in_proj output, on `batch`'s rows
        and state slots (planned on the host from them): [tokens, value_dim] before the gated norm."""
        g = self.gdn_geometry
        tokens = projected.shape[0]
        qkv, _, b, a = self._in_proj_parts(projected)
        rows = self._rows_of(batch)
        # A column view of the projection: every conv takes a strided row view (no copy made), and
        # gives q, k and v dense where its kernel can (the chunked delta rules read them dense).
        q, k, v = self.gdn.conv_pieces(
            qkv,
            layer.conv,
            rows,
            self.state.conv_layer(layer.state_index),
            (g.key_dim, g.key_dim, g.value_dim),
        )
        mixer = self.decode_mixer
        if mixer is not None:
            decay, beta = mixer.gates(a, b, layer.a_log, layer.dt_bias)
        else:
            decay, beta = reference.gdn_gates(a, b, layer.a_log, layer.dt_bias)
        core = self.gdn.delta_rule(
            q.reshape(tokens, g.num_key_heads, g.key_head_dim),
            k.reshape(tokens, g.num_key_heads, g.key_head_dim),
            v.reshape(tokens, g.num_value_heads, g.value_head_dim),
            decay,
            beta,
            rows,
            self.state.recurrent_layer(layer.state_index),
        )
        return core.reshape(tokens, g.value_dim)

    def _attention(self, layer: _Attention, projected: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """O's input from the QKV projection's output: this rank's heads, gated, [tokens, q_size]."""
        head_dim, q_size, kv_size = self.config.head_dim, self.q_size, self.kv_size
        tokens = projected.shape[0]
        q, k, v = projected.split([2 * q_size, kv_size, kv_size], dim=-1)
        pool_layer = self.kv.layer(0, layer.kv_index)
        q_rot, gate = run_attention_prep(
            self.prep,
            q.reshape(tokens, self.num_heads, 2 * head_dim),
            k.reshape(tokens, self.num_kv_heads, head_dim),
            v.reshape(tokens, self.num_kv_heads, head_dim),
            layer.q_norm,
            layer.k_norm,
            batch.rows[0],
            self.rope_table,
            pool_layer,
        )
        assert gate is not None  # the gated-Q prep always returns the gate
        attn = batch.attention.run(0, self.attn_spec, q_rot, pool_layer)
        gated = attn.reshape(tokens, self.num_heads, head_dim) * torch.sigmoid(gate)
        return gated.reshape(tokens, q_size)


def _mixer_projections(mixer: _DeltaNet | _Attention) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixer's input and output projection weights: in_proj and out_proj, or QKV and O (each
    output projection row-parallel under TP: a partial sum)."""
    if isinstance(mixer, _DeltaNet):
        return mixer.in_proj, mixer.out
    return mixer.qkv, mixer.o


def _split_of(plan: ShardPlan, kind: str) -> GroupedHeads | None:
    """The head split of the plan's layers of `kind` (every layer of a kind splits alike), or None
    when the model has no such layer."""
    for layer in plan.layers:
        if layer.kind == kind:
            split = layer.attention if kind == FULL else layer.gdn
            assert split is not None
            return split
    return None
