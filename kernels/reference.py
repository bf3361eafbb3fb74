"""The one host-side statement of the attention-prep ops, the projection GEMM, the Gated DeltaNet ops
and the sampler's token draw (the last two sections), in plain torch.

Fast kernels are tested against these functions and model code on the CPU calls them directly, so
they are written for use, not only for reading: batched over rows, positions per row.

Shapes: ``rows`` is a token batch (prefill chunks and decode rows mixed); per-head tensors are
``[rows, heads, head_dim]``; cos/sin are ``[rows, turning_pairs]``.

Rounding points (the storage dtype S is bf16, fp16 or fp32; ``R`` rounds fp32 to S, nearest-even):

- RMSNorm: ``inv = 1 / sqrt(mean(x²) + eps)`` in fp32 (IEEE sqrt and divide); ``n = x·inv`` in fp32.
  Weight ``w`` / ``1+w``: ``R(n · w)`` once (Gemma 3, Gemma 4, Qwen3.5), or, with ``round_before_weight``,
  ``R(w · R(n))`` (Qwen3 / Llama: the weight multiplies the already-stored value). No weight: ``R(n)``.
- Rotary: cos and sin are ``R(cos(p·f))``, ``R(sin(p·f))`` with ``p·f`` in fp32; for a pair
  ``(a, b)`` of already-normalised S values: ``a' = R(R(a·c) − R(b·s))``, ``b' = R(R(b·c) + R(a·s))``.
  That is what a model doing the rotation in S arithmetic (Hugging Face's ``q*cos + rotate_half(q)*sin``
  in bf16) computes; dims that do not turn are passed through bit for bit.
- Nothing else rounds: a gate is copied, V without a norm is copied.

Kernels must follow exactly these points; they may differ from this file only in the order of the
fp32 sum inside ``mean(x²)`` and in the last bit of fp32 transcendental functions (which the rope
table below removes from the comparison altogether).

Linear (the projections and the LM head, ``linear`` at the end): products and their sum in fp32,
rounded once to the storage dtype.

Attention over the paged pool (``paged_kv`` and ``attend_one_sequence``, after the slot addresses):
scores, softmax and the weighted sum of V in fp32 from the stored Q, K and V, rounded once to the
storage dtype. Every attention backend is compared with it; the torch backend runs it.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionLayerSpec
from kernels.kv_layout import K_INDEX, PAGE_SIZE, V_INDEX, ceil_div, check_pool_layer


class SpecError(ValueError):
    """Inputs that the spec does not define; the message names the offending value."""


class SlotAddressError(SpecError):
    """A row addresses a page-table entry that does not exist."""


# --------------------------------------------------------------------------------------------- norms


class NormWeight(enum.Enum):
    NONE = "none"
    W = "w"
    ONE_PLUS_W = "1+w"


@dataclass(slots=True, frozen=True)
class NormSpec:
    """One RMSNorm over the last dim.

    ``round_before_weight``: store the normalised value in the storage dtype first, then multiply by
    the weight and round again (Qwen3 and Llama); otherwise one rounding after the weight (Gemma 4,
    Qwen3.5).
    """

    weight: NormWeight
    eps: float = 1e-6
    round_before_weight: bool = False

    def __post_init__(self) -> None:
        if self.eps < 0:
            raise SpecError(f"eps must be non-negative, got {self.eps}")
        if self.round_before_weight and self.weight is NormWeight.NONE:
            raise SpecError("round_before_weight needs a weight, got NormWeight.NONE")


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 values to ``dtype`` (nearest-even) and return them as fp32 again."""
    return x.to(dtype).to(torch.float32)


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x²) + eps)`` over the last dim, in fp32, keepdim.

    The spec is this code run on the host. On CUDA, torch's mean multiplies the sum by a rounded
    1/n rather than dividing by n, so there it may sit an fp32 ulp off the spec where n is not a
    power of two (seen on the H200 at n = 96, 160). A kernel that divides matches the spec."""
    xf = x.to(torch.float32)
    mean_square = xf.square().mean(dim=-1, keepdim=True)
    return 1.0 / torch.sqrt(mean_square + eps)


def rms_norm(x: torch.Tensor, spec: NormSpec, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim, returned in ``x.dtype`` (rounding points: module doc)."""
    if (weight is None) != (spec.weight is NormWeight.NONE):
        raise SpecError(
            f"norm weight {spec.weight.value!r} was given weight={None if weight is None else 'tensor'}"
        )
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise SpecError(f"norm weight shape {tuple(weight.shape)} does not match last dim {x.shape[-1]}")
    normalised = x.to(torch.float32) * inverse_rms(x, spec.eps)
    if weight is None:
        return normalised.to(x.dtype)
    scale = weight.to(torch.float32)
    if spec.weight is NormWeight.ONE_PLUS_W:
        scale = 1.0 + scale
    if spec.round_before_weight:
        return (scale * round_to(normalised, x.dtype)).to(x.dtype)
    return (normalised * scale).to(x.dtype)


def residual_add(
    residual: torch.Tensor,
    delta: torch.Tensor,
    spec: NormSpec,
    *,
    delta_weight: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One update of the residual stream, each op in the storage dtype S as torch's ops round it:
    ``s = R(residual + d)`` with ``d = rms_norm(delta, spec, delta_weight)`` when ``delta_weight`` is
    given (Gemma 4's post-attention and post-feedforward norms), ``delta`` itself otherwise; then
    ``R(s · scale)`` when ``scale`` (one element, Gemma 4's layer scalar) is given."""
    if delta.shape != residual.shape or delta.dtype != residual.dtype:
        # torch would broadcast or promote here; the fused kernel does neither, so neither may this.
        raise SpecError(
            f"delta is {tuple(delta.shape)} {delta.dtype}, residual {tuple(residual.shape)} {residual.dtype}"
        )
    if delta_weight is not None:
        delta = rms_norm(delta, spec, delta_weight)
    summed = residual + delta
    if scale is not None:
        if scale.numel() != 1 or scale.dtype != residual.dtype:
            raise SpecError(f"scale is {tuple(scale.shape)} {scale.dtype}: one {residual.dtype} element")
        summed = summed * scale
    return summed


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor,
    spec: NormSpec,
    weight: torch.Tensor | None = None,
    *,
    delta_weight: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s, spec, weight))`` for ``s = residual_add(...)``: the residual step and the
    norm that reads its sum, which fused kernels compute in one launch."""
    summed = residual_add(residual, delta, spec, delta_weight=delta_weight, scale=scale)
    return summed, rms_norm(summed, spec, weight)


# ---------------------------------------------------------------------------------- gated activation


class GatedActivation(enum.Enum):
    SILU = "silu"  # SwiGLU: Qwen3, Qwen3.5
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation: Gemma


def gated_activation(gate_up: torch.Tensor, kind: GatedActivation) -> torch.Tensor:
    """``act(gate) · up`` for ``gate_up [..., 2I]`` (gate in the first half, up in the second, as the
    models fuse the two projections), in the storage dtype: the activation computed in fp32 and
    rounded once (torch's ``F.silu`` / ``F.gelu(approximate="tanh")``), the product rounded once.

    Kernels may differ from this in the last fp32 bit of ``exp`` / ``tanh`` only."""
    if gate_up.shape[-1] % 2:
        raise SpecError(f"gate_up last dim {gate_up.shape[-1]} is odd: gate and up halves must match")
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if kind is GatedActivation.SILU else F.gelu(gate, approximate="tanh")
    return act * up


# -------------------------------------------------------------------------------------------- rotary


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """Rotary embedding with rotate-half pairing.

    Ordinary (full or partial) rotary: the leading ``rotary_dim`` dims turn, pairs are
    ``(d, d + rotary_dim/2)``, frequencies ``theta^(-2i/rotary_dim)``; dims from ``rotary_dim`` on
    pass through.

    Proportional (Gemma 4 global layers): pairs span the whole head, ``(d, d + head_dim/2)``;
    frequencies are ``theta^(-2i/head_dim)`` for the first ``rotary_dim/2`` pairs and zero after,
    i.e. only those pairs turn (dims ``[0, rotary_dim/2)`` and ``[head_dim/2, head_dim/2 + rotary_dim/2)``).

    Linear scaling (transformers' ``linear`` rope type, Gemma 3's global layers from 4B up): every
    frequency is divided by ``linear_factor`` in fp32 after it is computed.
    """

    head_dim: int
    rotary_dim: int
    theta: float
    proportional: bool = False
    linear_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.head_dim < 2 or self.head_dim % 2:
            raise SpecError(f"head_dim must be even and positive, got {self.head_dim}")
        if self.rotary_dim < 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise SpecError(
                f"rotary_dim must be even and within head_dim={self.head_dim}, got {self.rotary_dim}"
            )
        if self.theta <= 0:
            raise SpecError(f"theta must be positive, got {self.theta}")
        if self.linear_factor <= 0:
            raise SpecError(f"linear_factor must be positive, got {self.linear_factor}")

    @classmethod
    def from_factor(
        cls, head_dim: int, theta: float, partial_rotary_factor: float = 1.0, *, proportional: bool = False
    ) -> RopeSpec:
        """Build from config facts the way Hugging Face derives the turning dims."""
        if not 0.0 <= partial_rotary_factor <= 1.0:
            raise SpecError(f"partial_rotary_factor must lie in [0, 1], got {partial_rotary_factor}")
        if proportional:
            rotary_dim = 2 * int(partial_rotary_factor * head_dim // 2)
        else:
            rotary_dim = int(head_dim * partial_rotary_factor)
        return cls(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta, proportional=proportional)

    @property
    def turning_pairs(self) -> int:
        return self.rotary_dim // 2

    @property
    def pair_offset(self) -> int:
        """Distance between the two dims of a pair."""
        return self.head_dim // 2 if self.proportional else self.rotary_dim // 2

    @property
    def exponent_denominator(self) -> int:
        return self.head_dim if self.proportional else self.rotary_dim


def inverse_frequencies(rope: RopeSpec) -> torch.Tensor:
    """fp32 ``[turning_pairs]``: ``1 / theta^(2i / exponent_denominator)``, then ``/ linear_factor``."""
    exponents = torch.arange(0, rope.rotary_dim, 2, dtype=torch.int64).to(torch.float32)
    inv_freq = 1.0 / (rope.theta ** (exponents / rope.exponent_denominator))
    return inv_freq if rope.linear_factor == 1.0 else inv_freq / rope.linear_factor


def rope_angles(positions: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """fp32 ``[rows, turning_pairs]``: ``position · inverse frequency``, one fp32 multiply."""
    inv_freq = inverse_frequencies(rope).to(positions.device)
    return positions.to(torch.float32)[:, None] * inv_freq[None, :]


def rope_cos_sin(
    positions: torch.Tensor, rope: RopeSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[rows, turning_pairs]`` for each row's position, rounded to ``dtype``."""
    angles = rope_angles(positions, rope)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_table(
    rope: RopeSpec, max_positions: int, dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[max_positions, 2, turning_pairs]``: cos (index 0) and sin (index 1) for every position.

    Built once per model and rope family; the fused op and the kernels read cos/sin from it, so a
    kernel and this spec see the very same bits (fp32 cos/sin differ in the last bit between
    libraries and devices).
    """
    if max_positions < 1:
        raise SpecError(f"max_positions must be at least 1, got {max_positions}")
    positions = torch.arange(max_positions, dtype=torch.int64)
    cos, sin = rope_cos_sin(positions, rope, dtype)
    return torch.stack((cos, sin), dim=1).to(device).contiguous()


def rope_lookup(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin rows of ``table`` for each position."""
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= table.shape[0]):
        bad = positions[(positions < 0) | (positions >= table.shape[0])][0]
        raise SpecError(f"position {int(bad)} is outside the rope table of {table.shape[0]} positions")
    rows = table[positions.long()]
    return rows[:, 0], rows[:, 1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Rotate ``x [rows, heads, head_dim]`` by per-row ``cos``/``sin [rows, turning_pairs]``."""
    if x.shape[-1] != rope.head_dim:
        raise SpecError(f"x has head_dim {x.shape[-1]}, the rope spec {rope.head_dim}")
    turning, offset = rope.turning_pairs, rope.pair_offset
    if tuple(cos.shape) != (x.shape[0], turning) or cos.shape != sin.shape:
        raise SpecError(f"cos/sin shapes {tuple(cos.shape)}/{tuple(sin.shape)} are not [rows, {turning}]")
    dtype = x.dtype
    xf = x.to(torch.float32)
    c = cos.to(torch.float32)[:, None, :]
    s = sin.to(torch.float32)[:, None, :]
    a = xf[..., :turning]
    b = xf[..., offset : offset + turning]
    out = xf.clone()
    out[..., :turning] = round_to(round_to(a * c, dtype) - round_to(b * s, dtype), dtype)
    out[..., offset : offset + turning] = round_to(round_to(b * c, dtype) + round_to(a * s, dtype), dtype)
    return out.to(dtype)


# ------------------------------------------------------------------------------------ slot addresses


@dataclass(slots=True, frozen=True)
class PagedRows:
    """Where each row of a token batch lives.

    ``positions [rows]``: the token's position in its sequence. ``seq_index [rows]``: which row of
    ``page_table [seqs, max_pages]`` holds its sequence's page ids. All int32 on the compute device.
    """

    positions: torch.Tensor
    seq_index: torch.Tensor
    page_table: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0])


def paged_slots(rows: PagedRows, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """int64 ``[rows]`` flat slots: ``page_table[seq, position // page_size] · page_size + position % page_size``."""
    positions = rows.positions.long()
    seq_index = rows.seq_index.long()
    seqs, max_pages = rows.page_table.shape
    if positions.shape != seq_index.shape:
        raise SlotAddressError(
            f"positions {tuple(positions.shape)} and seq_index {tuple(seq_index.shape)} differ"
        )
    bad_seq = (seq_index < 0) | (seq_index >= seqs)
    if bool(bad_seq.any()):
        i = int(bad_seq.nonzero()[0, 0])
        raise SlotAddressError(
            f"row {i}: seq_index {int(seq_index[i])} is outside the page table's {seqs} rows"
        )
    bad_position = (positions < 0) | (positions >= max_pages * page_size)
    if bool(bad_position.any()):
        i = int(bad_position.nonzero()[0, 0])
        raise SlotAddressError(
            f"row {i}: position {int(positions[i])} is outside the page table's {max_pages} pages of {page_size}"
        )
    pages = rows.page_table.long()[seq_index, positions // page_size]
    return pages * page_size + positions % page_size


def slot_pages_offsets(slots: torch.Tensor, page_size: int = PAGE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Split flat slots into ``(page, offset in page)``."""
    return slots // page_size, slots % page_size


def write_kv(pool_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store ``k``/``v [rows, kv_heads, head_dim]`` at their slots in one pool layer (in place)."""
    pages, offsets = slot_pages_offsets(slots.to(pool_layer.device))
    pool_layer[pages, K_INDEX, offsets] = k
    pool_layer[pages, V_INDEX, offsets] = v


# ------------------------------------------------------------------------------------- attention


def paged_kv(
    pool_layer: torch.Tensor, table: Sequence[int], kv_len: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[kv_len, kv_heads, head_dim]`` of one sequence whose positions live on the pages of
    ``table`` (position p on page ``table[p // 16]``, offset ``p % 16``), gathered from one pool layer."""
    pages = torch.tensor(table[: ceil_div(kv_len, PAGE_SIZE)], device=pool_layer.device, dtype=torch.long)
    kv = pool_layer.index_select(0, pages)  # [p, 2, page_size, Hkv, D]
    k = kv[:, K_INDEX].reshape(-1, kv_heads, head_dim)[:kv_len]
    v = kv[:, V_INDEX].reshape(-1, kv_heads, head_dim)[:kv_len]
    return k, v


def attend_one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayerSpec,
    accumulate: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q: [n, H, D] for the last n of the kv_len positions held in k, v: [kv_len, Hkv, D].

    Query i (position ``kv_len - n + i``) sees the positions up to its own and, with
    ``layer.window``, only the last ``window`` of them, its own included. Scores ``q·k · scale``,
    softmax and the sum over V in ``accumulate`` (fp32; tests pass fp64 for the exact value), then
    one rounding to q's dtype."""
    n, kv_len = q.shape[0], k.shape[0]
    kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
    group = layer.num_heads // kv_heads
    # Query head h reads KV head h // group. Folding a KV head's `group` query heads into its rows
    # ([Hkv, group·n, D]) attends them against K and V as stored, never a repeated copy.
    qf = (
        q.to(accumulate)
        .reshape(n, kv_heads, group, head_dim)
        .permute(1, 2, 0, 3)
        .reshape(kv_heads, group * n, head_dim)
    )
    kf = k.to(accumulate).transpose(0, 1)  # [Hkv, kv, D]
    vf = v.to(accumulate).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * layer.scale  # [Hkv, group·n, kv]
    q_pos = torch.arange(kv_len - n, kv_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=q.device).unsqueeze(0)
    visible = k_pos <= q_pos
    if layer.window is not None:
        visible &= k_pos > q_pos - layer.window
    scores = scores.view(kv_heads, group, n, kv_len).masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf.unsqueeze(1))  # [Hkv, group, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, layer.num_heads, head_dim).to(q.dtype)


# ---------------------------------------------------------------------------------- fused prep op


class VSource(enum.Enum):
    PROJECTION = "projection"  # V given and stored as is (Qwen3, Qwen3.5, Gemma 3)
    NORMED_PROJECTION = "normed_projection"  # V given, weightless RMSNorm, no rotation (Gemma 4 sliding)
    NORMED_RAW_K = "normed_raw_k"  # no V input: weightless RMSNorm of the raw K row (Gemma 4 global)


@dataclass(slots=True, frozen=True)
class PrepSpec:
    """One attention family's prep: Q/K norms, rotary, where V comes from, and Q's output gate.

    With ``q_gated`` each Q head arrives as ``[q | gate]`` (``2·head_dim`` wide); the gate is passed
    through untouched to its own output.
    """

    name: str
    head_dim: int
    q_norm: NormSpec
    k_norm: NormSpec
    v_source: VSource
    rope: RopeSpec
    q_gated: bool = False

    def __post_init__(self) -> None:
        if self.rope.head_dim != self.head_dim:
            raise SpecError(f"{self.name}: rope head_dim {self.rope.head_dim} is not {self.head_dim}")
        if self.q_norm.weight is NormWeight.NONE or self.k_norm.weight is NormWeight.NONE:
            raise SpecError(f"{self.name}: Q and K norms carry a weight in every supported family")

    @property
    def v_norm(self) -> NormSpec:
        return NormSpec(NormWeight.NONE, eps=self.k_norm.eps)

    @property
    def takes_v(self) -> bool:
        return self.v_source is not VSource.NORMED_RAW_K

    @property
    def q_width(self) -> int:
        """Width of one Q head in the input: the gate doubles it."""
        return 2 * self.head_dim if self.q_gated else self.head_dim


def qwen3_prep(head_dim: int = 128, theta: float = 1_000_000.0, eps: float = 1e-6) -> PrepSpec:
    norm = NormSpec(NormWeight.W, eps=eps, round_before_weight=True)
    return PrepSpec(
        name="qwen3",
        head_dim=head_dim,
        q_norm=norm,
        k_norm=norm,
        v_source=VSource.PROJECTION,
        rope=RopeSpec.from_factor(head_dim, theta),
    )


def qwen35_full_attention_prep(
    head_dim: int = 256, theta: float = 10_000_000.0, partial_rotary_factor: float = 0.25, eps: float = 1e-6
) -> PrepSpec:
    norm = NormSpec(NormWeight.ONE_PLUS_W, eps=eps)
    return PrepSpec(
        name="qwen35_full",
        head_dim=head_dim,
        q_norm=norm,
        k_norm=norm,
        v_source=VSource.PROJECTION,
        rope=RopeSpec.from_factor(head_dim, theta, partial_rotary_factor),
        q_gated=True,
    )


def gemma4_sliding_prep(head_dim: int = 256, theta: float = 10_000.0, eps: float = 1e-6) -> PrepSpec:
    norm = NormSpec(NormWeight.W, eps=eps)
    return PrepSpec(
        name="gemma4_sliding",
        head_dim=head_dim,
        q_norm=norm,
        k_norm=norm,
        v_source=VSource.NORMED_PROJECTION,
        rope=RopeSpec.from_factor(head_dim, theta),
    )


def gemma4_global_prep(
    head_dim: int = 512, theta: float = 1_000_000.0, partial_rotary_factor: float = 0.25, eps: float = 1e-6
) -> PrepSpec:
    norm = NormSpec(NormWeight.W, eps=eps)
    return PrepSpec(
        name="gemma4_global",
        head_dim=head_dim,
        q_norm=norm,
        k_norm=norm,
        v_source=VSource.NORMED_RAW_K,
        rope=RopeSpec.from_factor(head_dim, theta, partial_rotary_factor, proportional=True),
    )


def gemma3_prep(
    head_dim: int = 256, theta: float = 10_000.0, eps: float = 1e-6, linear_factor: float = 1.0
) -> PrepSpec:
    """Gemma 3, either layer kind (they differ only in the rotary): Q/K norms ``1+w``, V as projected."""
    norm = NormSpec(NormWeight.ONE_PLUS_W, eps=eps)
    rope = RopeSpec(head_dim=head_dim, rotary_dim=head_dim, theta=theta, linear_factor=linear_factor)
    return PrepSpec(
        name="gemma3",
        head_dim=head_dim,
        q_norm=norm,
        k_norm=norm,
        v_source=VSource.PROJECTION,
        rope=rope,
    )


@dataclass(slots=True, frozen=True)
class PrepOutputs:
    """Per-row results: ``q``/``gate [rows, q_heads, head_dim]`` and the K/V rows the pool receives."""

    q: torch.Tensor
    gate: torch.Tensor | None
    k: torch.Tensor
    v: torch.Tensor


def check_prep_inputs(
    spec: PrepSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
) -> None:
    """Shapes and dtypes the fused op accepts; raises SpecError naming the offending value."""
    if q.dim() != 3 or q.shape[-1] != spec.q_width:
        raise SpecError(f"{spec.name}: q must be [rows, q_heads, {spec.q_width}], got {tuple(q.shape)}")
    if k.dim() != 3 or k.shape[-1] != spec.head_dim or k.shape[0] != q.shape[0]:
        raise SpecError(
            f"{spec.name}: k must be [{q.shape[0]}, kv_heads, {spec.head_dim}], got {tuple(k.shape)}"
        )
    if spec.takes_v != (v is not None):
        raise SpecError(
            f"{spec.name}: V source {spec.v_source.value} but v is {'given' if v is not None else 'None'}"
        )
    if v is not None and v.shape != k.shape:
        raise SpecError(f"{spec.name}: v shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise SpecError(f"{spec.name}: {q.shape[1]} q heads are not a multiple of {k.shape[1]} kv heads")
    for name, t in (("k", k), ("v", v)):
        if t is not None and t.dtype != q.dtype:
            raise SpecError(f"{spec.name}: {name} dtype {t.dtype} differs from q {q.dtype}")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if tuple(w.shape) != (spec.head_dim,):
            raise SpecError(f"{spec.name}: {name} must be [{spec.head_dim}], got {tuple(w.shape)}")


def prep_rows(
    spec: PrepSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> PrepOutputs:
    """The fused op without the pool write: normalise, rotate, derive V, split off the gate."""
    check_prep_inputs(spec, q, k, v, q_norm_weight, k_norm_weight)
    q_in = q[..., : spec.head_dim]
    gate = q[..., spec.head_dim :].clone() if spec.q_gated else None
    q_out = apply_rope(rms_norm(q_in, spec.q_norm, q_norm_weight), cos, sin, spec.rope)
    k_out = apply_rope(rms_norm(k, spec.k_norm, k_norm_weight), cos, sin, spec.rope)
    if spec.v_source is VSource.PROJECTION:
        assert v is not None
        v_out = v.clone()
    elif spec.v_source is VSource.NORMED_PROJECTION:
        assert v is not None
        v_out = rms_norm(v, spec.v_norm)
    else:
        v_out = rms_norm(k, spec.v_norm)
    return PrepOutputs(q=q_out, gate=gate, k=k_out, v=v_out)


def attention_prep(
    spec: PrepSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    rows: PagedRows,
    rope_cos_sin_table: torch.Tensor,
    kv_pool_layer: torch.Tensor,
) -> PrepOutputs:
    """The fused prep op: ``prep_rows`` with cos/sin from the rope table, then K/V into their slots.

    ``kv_pool_layer`` is ``pool[layer]`` (``kernels.kv_layout``) and is written in place. Rows that
    map to the padding page write there like any other row.
    """
    check_pool_layer(kv_pool_layer, k.shape[1], spec.head_dim)
    cos, sin = rope_lookup(rope_cos_sin_table, rows.positions)
    out = prep_rows(spec, q, k, v, q_norm_weight, k_norm_weight, cos, sin)
    write_kv(kv_pool_layer, paged_slots(rows), out.k, out.v)
    return out


# ----------------------------------------------------------------------------------------- embedding


def embedding_scale(
    hidden_size: int, dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """The factor Gemma multiplies its embeddings by: √hidden, computed in fp32 and stored in the
    weight dtype before it multiplies (bf16: √3840 → 62.0, √640 → 25.25)."""
    return torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype).to(device)


# -------------------------------------------------------------------------------------------- linear


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for x [..., K] and weight [N, K]: ``F.linear`` with fp32 accumulation, rounded
    once (nearest-even) to the storage dtype S of x.

    Every product ``x_k · w_k`` and the whole sum over K are fp32; nothing is rounded to S before the
    end. For bf16 and fp16 operands each product is exact in fp32 (8 + 8 and 11 + 11 significant bits
    fit fp32's 24), so a kernel may differ from this function in one thing only: **the order of the
    fp32 sum** (its K tiling, a split-K's partial sums and the order they are added in; tensor cores
    add a group of products in one step, whose intermediate rounding is the hardware's). For fp32
    operands the products round in fp32 too, so a kernel may
    also differ in whether a product is rounded before it is added (FMA). This function's own order
    is whatever torch's fp32 GEMM on the host picks; the skinny GEMM's tests hold kernels to what
    reordering this sum costs, measured (tests/kernels/linear_bounds.py, docs/kernels.md).
    """
    if x.dtype != weight.dtype:
        raise SpecError(f"linear: x dtype {x.dtype} differs from weight dtype {weight.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise SpecError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not share K")
    return F.linear(x.to(torch.float32), weight.to(torch.float32)).to(x.dtype)


# ----------------------------------------------------------------- projections with their neighbours
#
# What the fused decode GEMV computes (docs/kernels.md, "The fused decode GEMV"): a projection with
# the op before or after it in a layer, defined as the composition of the ops above, so a fused
# kernel has the freedoms of its parts and no other (the fp32 order of the linear's sum and of the
# norm's sum of squares, the last fp32 bit of exp / tanh).

_NO_NORM = NormSpec(NormWeight.NONE)


def norm_linear(
    h: torch.Tensor, spec: NormSpec, norm_weight: torch.Tensor | None, weight: torch.Tensor
) -> torch.Tensor:
    """``linear(rms_norm(h, spec, norm_weight), weight)``: a layer's input norm and its projection."""
    return linear(rms_norm(h, spec, norm_weight), weight)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual_add(residual, linear(x, weight))``: a projection added to the residual stream."""
    return residual_add(residual, linear(x, weight), _NO_NORM)


def linear_gated(x: torch.Tensor, weight: torch.Tensor, kind: GatedActivation) -> torch.Tensor:
    """``gated_activation(linear(x, weight), kind)`` for a fused ``[2I, K]`` gate/up weight."""
    return gated_activation(linear(x, weight), kind)


# ------------------------------------------------------------------------- gated DeltaNet (Qwen3.5)
#
# The three ops of a Gated DeltaNet layer (docs/kernels.md, "Gated DeltaNet"). Shapes are per token
# batch: ``T`` tokens of one or more sequences packed back to back, ``cu_seqlens [N + 1]`` their
# boundaries (host ints). Key heads ``Hk`` and value heads ``Hv`` (``Hv % Hk == 0``): value head
# ``h`` reads key head ``h // (Hv / Hk)``; q and k are never repeated to Hv heads.
#
# The recurrent state of one sequence is ``[Hv, V, K]`` fp32 ("state_v_first", FlashInfer's and
# vLLM's layout); the conv state of one sequence is ``[W - 1, D]`` in the storage dtype: the last
# W - 1 raw inputs of the conv (zeros before the first token).

L2_NORM_EPS = 1e-6


def check_cu_seqlens(cu_seqlens: Sequence[int], tokens: int) -> None:
    """``cu_seqlens`` starts at 0, never decreases and ends at ``tokens``."""
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != tokens:
        raise SpecError(f"cu_seqlens {list(cu_seqlens)} must run from 0 to the {tokens} tokens")
    if any(b < a for a, b in itertools.pairwise(cu_seqlens)):
        raise SpecError(f"cu_seqlens {list(cu_seqlens)} must not decrease")


def l2_normalize(
    x: torch.Tensor, eps: float = L2_NORM_EPS, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``x · rsqrt(Σx² + eps)`` over the last dim, computed and returned in ``dtype`` (fp32)."""
    xf = x.to(dtype)
    return xf * torch.rsqrt(xf.square().sum(dim=-1, keepdim=True) + eps)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token, per-value-head decay and write strength from ``a``, ``b [T, Hv]``.

    ``g = −exp(A_log)·softplus(a + dt_bias)`` in fp32 (log space: the state is multiplied by
    ``exp(g)``); ``β = R(sigmoid(b))``, rounded to b's storage dtype as transformers computes it."""
    g = -a_log.to(torch.float32).exp() * F.softplus(a.to(torch.float32) + dt_bias.to(torch.float32))
    beta = torch.sigmoid(b.to(torch.float32)).to(b.dtype)
    return g, beta


def _check_gdn_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[int, int]:
    """(Hv, value heads per key head); SpecError naming the shape that does not fit."""
    if q.dim() != 3 or q.shape != k.shape:
        raise SpecError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must both be [T, Hk, K]")
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise SpecError(f"v must be [{q.shape[0]}, Hv, V], got {tuple(v.shape)}")
    heads = v.shape[1]
    if heads % q.shape[1]:
        raise SpecError(f"{heads} value heads are not a multiple of {q.shape[1]} key heads")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (v.shape[0], heads):
            raise SpecError(f"{name} must be [{v.shape[0]}, {heads}], got {tuple(t.shape)}")
    return heads, heads // q.shape[1]


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: Sequence[int],
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    accumulate: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, token by token in fp32: ``(o [T, Hv, V] in v.dtype, final state
    [N, Hv, V, K] fp32)``. ``accumulate=torch.float64`` runs the same steps in fp64: the oracle
    tests measure the spec's own fp32 error against, and a fast form's beside it.

    Per sequence, from ``S = initial_state[n]`` (zeros when None), for each token t and value head:
    ``q̂ = l2(q)·scale`` (scale defaults to ``K^-½``), ``k̂ = l2(k)``;
    ``S ← S·exp(g)``; ``δ = β·(v − S·k̂)``; ``S ← S + δ ⊗ k̂``; ``o = S·q̂``. Only ``o`` is rounded,
    once, to the storage dtype. Fast forms (chunked, fused) may differ from this in the order of
    fp32 sums only (kernels/gdn/)."""
    heads, group = _check_gdn_inputs(q, k, v, g, beta)
    check_cu_seqlens(cu_seqlens, q.shape[0])
    sequences, key_dim, value_dim = len(cu_seqlens) - 1, q.shape[-1], v.shape[-1]
    shape = (sequences, heads, value_dim, key_dim)
    if initial_state is not None and tuple(initial_state.shape) != shape:
        raise SpecError(f"initial_state must be {list(shape)}, got {list(initial_state.shape)}")
    scale = key_dim**-0.5 if scale is None else scale
    # Value head h reads key head h // group: index, never copy, the key heads.
    kq_head = torch.arange(heads, device=q.device) // group
    qf = (l2_normalize(q, dtype=accumulate) * scale)[:, kq_head]
    kf = l2_normalize(k, dtype=accumulate)[:, kq_head]
    vf, gf, bf = v.to(accumulate), g.to(accumulate), beta.to(accumulate)
    out = torch.empty(v.shape, dtype=accumulate, device=v.device)
    final = torch.empty(shape, dtype=accumulate, device=v.device)
    for n in range(sequences):
        state = (
            torch.zeros(shape[1:], dtype=accumulate, device=v.device)
            if initial_state is None
            else initial_state[n].to(accumulate).clone()
        )
        for t in range(cu_seqlens[n], cu_seqlens[n + 1]):
            state = state * gf[t].exp()[:, None, None]
            predicted = (state * kf[t][:, None, :]).sum(-1)
            delta = bf[t][:, None] * (vf[t] - predicted)
            state = state + delta[:, :, None] * kf[t][:, None, :]
            out[t] = (state * qf[t][:, None, :]).sum(-1)
        final[n] = state
    return out.to(v.dtype), final


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: Sequence[int],
    initial_state: torch.Tensor | None = None,
    accumulate: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time with SiLU: ``(y [T, D] in x.dtype, final state
    [N, W - 1, D] in x.dtype)`` for ``x [T, D]`` and ``weight [D, W]`` (transformers'
    ``conv1d.weight`` without its middle dim).

    Per sequence, the inputs are the state's W - 1 rows (zeros when None) followed by the
    sequence's tokens; ``y_t = R(silu(R(Σ_j weight[:, j] · x_{t - W + 1 + j})))`` with the sum in
    fp32: the conv's output is stored, then the activation (two roundings, as transformers' torch
    path computes in the storage dtype). The final state is the last W - 1 inputs, so a sequence
    shorter than W - 1 keeps part of its initial state. ``accumulate=torch.float64`` sums in fp64
    (the tests' oracle; the roundings to the storage dtype stay)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise SpecError(
            f"x [T, D] and weight [D, W] must share D, got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    check_cu_seqlens(cu_seqlens, x.shape[0])
    sequences, channels, width = len(cu_seqlens) - 1, x.shape[1], weight.shape[1]
    shape = (sequences, width - 1, channels)
    if initial_state is not None and tuple(initial_state.shape) != shape:
        raise SpecError(f"initial_state must be {list(shape)}, got {list(initial_state.shape)}")
    w = weight.to(accumulate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    final = torch.empty(shape, dtype=x.dtype, device=x.device)
    for n in range(sequences):
        start, end = cu_seqlens[n], cu_seqlens[n + 1]
        history = (
            torch.zeros(shape[1:], dtype=x.dtype, device=x.device)
            if initial_state is None
            else initial_state[n]
        )
        inputs = torch.cat([history.to(x.dtype), x[start:end]])
        xf = inputs.to(accumulate)
        for i in range(end - start):
            window = xf[i : i + width]  # [W, D]: the token (last row) and the W - 1 before it
            conv = (window * w.T).sum(0).to(x.dtype)
            out[start + i] = F.silu(conv.to(accumulate)).to(x.dtype)
        final[n] = inputs[inputs.shape[0] - (width - 1) :]
    return out, final


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm over the last dim (``V``) of ``x``, gated by ``gate`` (same shape):
    ``R(w · R(n) · silu(gate))`` with ``n = x·inv_rms(x)`` in fp32, the weight (plain ``w``, kept
    fp32) and the gate's SiLU in fp32, and one rounding at the end besides the stored ``R(n)``.

    transformers rounds ``n`` to the storage dtype before the weight too; with its weight in bf16 it
    also rounds ``w · R(n)``, which fp32 weights (as the checkpoints store them) do not."""
    if gate.shape != x.shape:
        raise SpecError(f"gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise SpecError(f"gated norm weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    normalised = round_to(x.to(torch.float32) * inverse_rms(x, eps), x.dtype)
    gated = normalised * weight.to(torch.float32) * F.silu(gate.to(torch.float32))
    return gated.to(x.dtype)


def gdn_mixer(
    qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    key_heads: int,
    cu_seqlens: Sequence[int],
    conv_state: torch.Tensor | None = None,
    recurrent_state: torch.Tensor | None = None,
    accumulate: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GDN layer between its input and output projections, the composition of the ops above:
    ``causal_conv1d`` of ``qkv [T, 2·Hk·K + Hv·V]`` (SiLU included), split into q, k, v;
    ``gdn_gates(a, b, a_log, dt_bias)`` for ``a, b [T, Hv]``; ``gated_delta_rule``; ``gated_rms_norm``
    by ``z [T, Hv·V]`` per value head. Returns ``(out [T, Hv·V], conv final [N, W - 1, D], recurrent
    final [N, Hv, V, K])``. ``accumulate=torch.float64`` runs the conv and the delta rule in fp64 (the
    oracle: give it fp64 inputs and it keeps no storage rounding but the stated ones)."""
    value_heads = a.shape[-1]
    if z.dim() != 2 or z.shape[-1] % value_heads or b.shape != a.shape:
        raise SpecError(
            f"z [T, Hv·V], b and a [T, Hv] disagree: {tuple(z.shape)}, {tuple(b.shape)}, {tuple(a.shape)}"
        )
    tokens, value_width = z.shape
    key_width = (qkv.shape[-1] - value_width) // 2
    if key_width < 1 or key_width % key_heads or 2 * key_width + value_width != qkv.shape[-1]:
        raise SpecError(f"qkv width {qkv.shape[-1]} is not 2·Hk·K + {value_width} with Hk = {key_heads}")
    key_dim, value_dim = key_width // key_heads, value_width // value_heads
    mixed, conv_final = causal_conv1d(qkv, conv_weight, cu_seqlens, conv_state, accumulate)
    q, k, v = mixed.split([key_width, key_width, value_width], dim=-1)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    core, recurrent_final = gated_delta_rule(
        q.reshape(tokens, key_heads, key_dim),
        k.reshape(tokens, key_heads, key_dim),
        v.reshape(tokens, value_heads, value_dim),
        g,
        beta,
        cu_seqlens,
        recurrent_state,
        accumulate=accumulate,
    )
    normed = gated_rms_norm(core, z.reshape(tokens, value_heads, value_dim), norm_weight, eps)
    return normed.reshape(tokens, value_width), conv_final, recurrent_final


# -------------------------------------------------------------------------- sampling: the token draw
#
# What the engine's sampler draws a token with (docs/engine.md, "Sampling"; the kernel in
# kernels/triton/token_draw.py). The noise is a stateless integer hash of (seed, step, token id), so
# a seeded row draws the same token whatever batch it lands in, at whatever row. The hash works on
# 32-bit words held in int64 tensors; multiplications are split into 16-bit halves so that no
# intermediate exceeds 2**48 (signed int64 overflow is undefined in C++, and every backend must give
# the same bits). A kernel does the same arithmetic in native uint32, which wraps mod 2**32: bit for
# bit the same words.

_WORD_MASK = 0xFFFFFFFF
_HALF_MASK = 0xFFFF

# Multipliers of a well-mixing 32-bit finaliser (shift 16, multiply, shift 15, multiply, shift 16).
NOISE_MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
NOISE_MIX_SHIFTS = (16, 15, 16)
# Domain separators so the two per-row keys are independent functions of (seed, step).
NOISE_KEY_DOMAINS = (0x243F6A88, 0x85A308D3)
# The largest float32 below 1.0: keeps the uniform strictly inside (0, 1) after rounding.
UNIFORM_BELOW_ONE = 1.0 - 2.0**-24


def _multiply_word_(words: torch.Tensor, multiplier: int) -> torch.Tensor:
    """In place: words * multiplier mod 2**32, never forming a product above 2**48."""
    high = words * (multiplier >> 16)
    high.bitwise_and_(_HALF_MASK).bitwise_left_shift_(16)
    words.mul_(multiplier & _HALF_MASK).add_(high).bitwise_and_(_WORD_MASK)
    return words


def _mix_words_(words: torch.Tensor) -> torch.Tensor:
    """In place: a bijective avalanche mix of 32-bit words (all inputs non-negative, < 2**32)."""
    first, second, third = NOISE_MIX_SHIFTS
    words.bitwise_xor_(words >> first)
    _multiply_word_(words, NOISE_MIX_MULTIPLIERS[0])
    words.bitwise_xor_(words >> second)
    _multiply_word_(words, NOISE_MIX_MULTIPLIERS[1])
    words.bitwise_xor_(words >> third)
    return words


def mix_words(words: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mix of int64 tensors holding values in [0, 2**32)."""
    if words.dtype != torch.int64:
        raise SpecError(f"mix_words needs int64 words, got {words.dtype}")
    return _mix_words_(words.clone())


def noise_row_keys(seed: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row (int64 tensors) from its 64-bit seed and its step index ([rows] int64):
    per domain, mix(mix(mix(seed_low ^ domain) ^ seed_high) ^ step_low)."""
    seed_low = seed & _WORD_MASK
    # Arithmetic shift then mask yields the high word's bits for negative seeds too.
    seed_high = (seed >> 32) & _WORD_MASK
    step_word = step & _WORD_MASK

    def absorb(domain: int) -> torch.Tensor:
        state = _mix_words_(seed_low ^ domain)
        state = _mix_words_(state.bitwise_xor_(seed_high))
        return _mix_words_(state.bitwise_xor_(step_word))

    return absorb(NOISE_KEY_DOMAINS[0]), absorb(NOISE_KEY_DOMAINS[1])


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), float32 [rows, vocab_size]; entry (r, v) depends only on
    (seed[r], step[r], v), not on the row's position, the batch size or ``vocab_size``:
    ``w = mix(mix(v ^ key_1) ^ key_2)``, ``u = min((float32(w) + 0.5) · 2⁻³², UNIFORM_BELOW_ONE)``
    with each float op rounded in fp32."""
    key_1, key_2 = noise_row_keys(seed, step)
    token_ids = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    # Keying the token id twice, with two independent row keys, keeps two rows whose first keys
    # happen to differ by a few low bits from seeing shifted copies of one another's noise.
    words = token_ids.unsqueeze(0) ^ key_1.unsqueeze(1)
    _mix_words_(words)
    words.bitwise_xor_(key_2.unsqueeze(1))
    _mix_words_(words)
    uniform = words.to(torch.float32).add_(0.5).mul_(2.0**-32)
    return uniform.clamp_(max=UNIFORM_BELOW_ONE)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, float32 [rows, vocab_size], as ``uniform_noise`` keys it.

    ``-log(E)`` with ``E = -log1p(-U)`` exponential, in fp32: ``log1p`` keeps E accurate when it is
    tiny, which is where the large (decisive) Gumbel values come from. The range is bounded, about
    [-2.8, 22.9]; a token more than ~25 nats below the best one can never win, an error below 1e-10
    in probability. Kernels may differ from this in the last fp32 bits of ``log1p`` and ``log``."""
    uniform = uniform_noise(seed, step, vocab_size)
    exponential = torch.log1p(uniform.neg_()).neg_()
    return exponential.log_().neg_()


def relative_probs(scaled_logits: torch.Tensor) -> torch.Tensor:
    """``exp(s − max s)`` per row: each token's probability over the top token's, exactly 1 at the top."""
    return torch.exp(scaled_logits - scaled_logits.amax(dim=-1, keepdim=True))


def min_p_keep(scaled_logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """bool [rows, vocab]: the tokens min-p keeps, ``relative_probs >= min_p``, every token where
    ``min_p <= 0`` (off exactly, so a row with min-p off never depends on its row maximum)."""
    off = (min_p <= 0).unsqueeze(1)
    return (relative_probs(scaled_logits) >= min_p.unsqueeze(1)) | off


@dataclass(slots=True, frozen=True)
class DrawRows:
    """Per-row inputs of the token draw, each ``[rows]`` on the logits' device: float32 ``temperature``
    (positive; 1.0 on greedy rows) and ``min_p`` (<= 0: off); int64 ``greedy`` (nonzero: take the
    argmax of the raw logits), ``seed`` (64-bit) and ``step`` (the noise counter)."""

    temperature: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor
    seed: torch.Tensor
    step: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    def check(self, logits: torch.Tensor) -> None:
        """SpecError naming the field whose shape, dtype or device does not fit ``logits``."""
        if logits.dim() != 2 or logits.shape[1] < 1:
            raise SpecError(f"logits.shape={tuple(logits.shape)}: expected [rows, vocab >= 1]")
        rows = logits.shape[0]
        for name, dtype in (
            ("temperature", torch.float32),
            ("min_p", torch.float32),
            ("greedy", torch.int64),
            ("seed", torch.int64),
            ("step", torch.int64),
        ):
            t = getattr(self, name)
            if tuple(t.shape) != (rows,) or t.dtype != dtype or t.device != logits.device:
                raise SpecError(
                    f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}: expected ({rows},) {dtype} "
                    f"on {logits.device}"
                )


def draw_tokens(logits: torch.Tensor, rows: DrawRows, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The token of every row of ``logits [rows, vocab]`` (any float dtype, computed in fp32), int64
    ``[rows]``.

    Greedy rows: the argmax of the raw logits. Other rows: ``s = logits / temperature`` (IEEE
    divide), the survivors of ``min_p_keep(s)`` and of ``keep`` (bool ``[rows, vocab]``: what top-k
    and top-p left, None for all), then the argmax over survivors of ``s + gumbel_noise`` (one fp32
    add) — a Gumbel-max draw, exact from the softmax of the surviving scaled logits. Every argmax
    breaks ties by the lowest token id (all candidates ``-inf``: token 0). Each row's token is a
    function of that row alone; rows with NaN logits draw an unspecified token."""
    rows.check(logits)
    if keep is not None and (keep.shape != logits.shape or keep.dtype != torch.bool):
        raise SpecError(f"keep is {tuple(keep.shape)} {keep.dtype}: expected {tuple(logits.shape)} bool")
    raw = logits.float()
    scaled = raw / rows.temperature.unsqueeze(1)
    allowed = min_p_keep(scaled, rows.min_p)
    if keep is not None:
        allowed &= keep
    noisy = scaled + gumbel_noise(rows.seed, rows.step, logits.shape[1])
    drawn = noisy.masked_fill_(~allowed, float("-inf")).argmax(dim=-1)
    return torch.where(rows.greedy != 0, raw.argmax(dim=-1), drawn)
