"""Closed-form anchors for kernels.reference: one per operator contract, with exact expected values.

Inputs are small integers and powers of two so every expected output is exact in bf16; eps is 0
where it would otherwise blur an exact root.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_layout import PAGE_SIZE, KVPoolLayout, k_pages, v_pages
from kernels.reference import (
    NormSpec,
    NormWeight,
    PagedRows,
    RopeSpec,
    SlotAddressError,
    SpecError,
    apply_rope,
    attention_prep,
    gemma4_global_prep,
    gemma4_sliding_prep,
    inverse_frequencies,
    paged_slots,
    qwen3_prep,
    qwen35_full_attention_prep,
    rms_norm,
    rope_angles,
    rope_lookup,
    rope_table,
    round_to,
    write_kv,
)

BF16 = torch.bfloat16

# mean(x²) = (7·1 + 25) / 8 = 4, so rms = 2 and x / rms = [0.5 ×7, 2.5].
ROW = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]
NORMALISED = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 2.5]


def bf16(values: list[float] | list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=BF16)


def assert_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert torch.equal(actual.view(torch.int16), expected.view(torch.int16)), f"{actual} != {expected}"


# ---------------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("round_before_weight", [False, True])
def test_rms_norm_with_weight_w_multiplies_by_w(round_before_weight: bool) -> None:
    weight = bf16([2.0, 1.0, 0.5, 4.0, 1.0, 1.0, 1.0, 0.25])
    spec = NormSpec(NormWeight.W, eps=0.0, round_before_weight=round_before_weight)
    assert_bits(rms_norm(bf16([ROW]), spec, weight), bf16([[1.0, 0.5, 0.25, 2.0, 0.5, 0.5, 0.5, 0.625]]))


def test_rms_norm_with_weight_one_plus_w_multiplies_by_one_plus_w() -> None:
    weight = bf16([1.0, 0.0, -0.5, 3.0, 0.0, 0.0, 0.0, -0.75])
    out = rms_norm(bf16([ROW]), NormSpec(NormWeight.ONE_PLUS_W, eps=0.0), weight)
    assert_bits(out, bf16([[1.0, 0.5, 0.25, 2.0, 0.5, 0.5, 0.5, 0.625]]))


def test_rms_norm_without_weight_only_normalises() -> None:
    assert_bits(
        rms_norm(bf16([ROW, [-4.0 * v for v in ROW]]), NormSpec(NormWeight.NONE, eps=0.0)),
        bf16([NORMALISED, [-v for v in NORMALISED]]),
    )


def test_rms_norm_eps_keeps_a_zero_row_finite() -> None:
    out = rms_norm(torch.zeros(1, 8, dtype=BF16), NormSpec(NormWeight.NONE, eps=1e-6))
    assert_bits(out, torch.zeros(1, 8, dtype=BF16))


def test_rms_norm_rounding_points_are_where_the_spec_says() -> None:
    """Weight after one rounding (Gemma, Qwen3.5) vs weight on the stored value (Qwen3).

    Stated as relations between spec calls: the fp32-storage norm is the unrounded value.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=generator).to(BF16)
    weight = (1.0 + 0.3 * torch.randn(128, generator=generator)).to(BF16)
    unrounded = rms_norm(x.float(), NormSpec(NormWeight.NONE))
    stored = rms_norm(x, NormSpec(NormWeight.NONE))

    once = rms_norm(x, NormSpec(NormWeight.W), weight)
    twice = rms_norm(x, NormSpec(NormWeight.W, round_before_weight=True), weight)
    assert_bits(once, (unrounded * weight.float()).to(BF16))
    assert_bits(twice, (weight.float() * stored.float()).to(BF16))
    # The two conventions really are different functions in bf16.
    assert (once != twice).float().mean() > 0.05


def test_norm_spec_rejects_a_missing_or_surplus_weight() -> None:
    with pytest.raises(SpecError, match="weight"):
        rms_norm(bf16([ROW]), NormSpec(NormWeight.W))
    with pytest.raises(SpecError, match="weight"):
        rms_norm(bf16([ROW]), NormSpec(NormWeight.NONE), bf16(ROW))


# ----------------------------------------------------------------------------------------- rotary


def test_inverse_frequencies_full_partial_and_proportional() -> None:
    # theta = 16 makes every frequency a power of two: 16^(-2i/d).
    full = RopeSpec(head_dim=8, rotary_dim=8, theta=16.0)
    partial = RopeSpec(head_dim=8, rotary_dim=4, theta=16.0)
    proportional = RopeSpec(head_dim=8, rotary_dim=4, theta=16.0, proportional=True)
    assert inverse_frequencies(full).tolist() == [1.0, 0.5, 0.25, 0.125]  # exponent over 8
    assert inverse_frequencies(partial).tolist() == [1.0, 0.25]  # exponent over the 4 turning dims
    assert inverse_frequencies(proportional).tolist() == [1.0, 0.5]  # exponent over the full 8


def test_rope_geometry_of_the_real_families() -> None:
    cases = {
        "qwen3": (qwen3_prep().rope, 128, 64, 64, 128),
        "qwen35": (qwen35_full_attention_prep().rope, 64, 32, 32, 64),
        "gemma4_sliding": (gemma4_sliding_prep().rope, 256, 128, 128, 256),
        "gemma4_global": (gemma4_global_prep().rope, 128, 64, 256, 512),
    }
    for name, (rope, rotary_dim, turning, offset, denominator) in cases.items():
        got = (rope.rotary_dim, rope.turning_pairs, rope.pair_offset, rope.exponent_denominator)
        assert got == (rotary_dim, turning, offset, denominator), name


def test_rope_angles_are_position_times_frequency() -> None:
    rope = RopeSpec(head_dim=8, rotary_dim=8, theta=16.0)
    angles = rope_angles(torch.tensor([0, 3]), rope)
    assert angles.tolist() == [[0.0, 0.0, 0.0, 0.0], [3.0, 1.5, 0.75, 0.375]]


X8 = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


@pytest.mark.parametrize(
    ("rope", "expected"),
    [
        # Full: pairs (d, d+4).
        (RopeSpec(8, 8, 16.0), [-5.0, -6.0, -7.0, -8.0, 1.0, 2.0, 3.0, 4.0]),
        # Partial: pairs (d, d+2) inside the leading 4 dims; dims 4..7 pass.
        (RopeSpec(8, 4, 16.0), [-3.0, -4.0, 1.0, 2.0, 5.0, 6.0, 7.0, 8.0]),
        # Proportional: pairs (d, d+4) across the head, only the first two turn.
        (RopeSpec(8, 4, 16.0, proportional=True), [-5.0, -6.0, 3.0, 4.0, 1.0, 2.0, 7.0, 8.0]),
    ],
    ids=["full", "partial", "proportional"],
)
def test_quarter_turn_shows_the_pairing(rope: RopeSpec, expected: list[float]) -> None:
    turning = rope.turning_pairs
    cos = torch.zeros(1, turning, dtype=BF16)
    sin = torch.ones(1, turning, dtype=BF16)
    assert_bits(apply_rope(bf16([[X8]]), cos, sin, rope), bf16([[expected]]))


def test_rotation_rounds_each_product_then_the_sum() -> None:
    # a·c = 1.0078125·1.5 = 1.51171875 is a bf16 tie and rounds to even, 1.515625; minus
    # R(b·s) = 1 gives 0.515625. One rounding at the end would give 0.51171875.
    # b·c + a·s = 1.5 + 1.0078125 = 2.5078125, a tie again: 2.5.
    rope = RopeSpec(head_dim=2, rotary_dim=2, theta=16.0)
    out = apply_rope(bf16([[[1.0078125, 1.0]]]), bf16([[1.5]]), bf16([[1.0]]), rope)
    assert_bits(out, bf16([[[0.515625, 2.5]]]))


def test_rope_table_holds_cos_then_sin_per_position() -> None:
    rope = RopeSpec(head_dim=8, rotary_dim=8, theta=16.0)
    table = rope_table(rope, 5, BF16)
    assert tuple(table.shape) == (5, 2, 4)
    cos, sin = rope_lookup(table, torch.tensor([0, 0]))
    assert_bits(cos, torch.ones(2, 4, dtype=BF16))
    assert_bits(sin, torch.zeros(2, 4, dtype=BF16))
    with pytest.raises(SpecError, match="position 5"):
        rope_lookup(table, torch.tensor([1, 5]))


# -------------------------------------------------------------------------------------- addresses


def test_paged_slot_is_page_times_sixteen_plus_offset() -> None:
    rows = PagedRows(
        positions=torch.tensor([0, 17, 47, 5], dtype=torch.int32),
        seq_index=torch.tensor([0, 0, 0, 1], dtype=torch.int32),
        page_table=torch.tensor([[7, 3, 9], [0, 0, 0]], dtype=torch.int32),
    )
    assert paged_slots(rows).tolist() == [7 * 16, 3 * 16 + 1, 9 * 16 + 15, 0 * 16 + 5]


def test_paged_slot_rejects_rows_outside_the_table() -> None:
    table = torch.tensor([[7, 3, 9]], dtype=torch.int32)
    with pytest.raises(SlotAddressError, match="position 48"):
        paged_slots(
            PagedRows(torch.tensor([1, 48], dtype=torch.int32), torch.zeros(2, dtype=torch.int32), table)
        )
    with pytest.raises(SlotAddressError, match="seq_index 1"):
        paged_slots(PagedRows(torch.tensor([1], dtype=torch.int32), torch.ones(1, dtype=torch.int32), table))


def test_pool_layer_is_flashinfer_nhd_and_kv_lands_in_its_slot() -> None:
    layout = KVPoolLayout(layers=3, pages=5, kv_heads=2, head_dim=4)
    pool = torch.full(layout.shape, -1.0, dtype=BF16)
    layer = pool[1]
    # FlashInfer's single-tensor NHD paged cache: [pages, 2, page_size, kv_heads, head_dim].
    assert tuple(layer.shape) == (5, 2, PAGE_SIZE, 2, 4) and layer.is_contiguous()
    k = torch.arange(8, dtype=BF16).view(1, 2, 4)
    v = k + 100
    write_kv(layer, torch.tensor([3 * PAGE_SIZE + 1]), k, v)
    assert_bits(k_pages(layer)[3, 1], k[0])
    assert_bits(v_pages(layer)[3, 1], v[0])
    written = torch.zeros(layout.shape, dtype=torch.bool)
    written[1, 3, :, 1] = True
    assert bool((pool[~written] == -1.0).all())


# ---------------------------------------------------------------------------- fused composition


def _single_row_prep(spec_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, position: int):
    spec = {
        "gemma4_global": gemma4_global_prep(head_dim=8, theta=16.0),
        "gemma4_sliding": gemma4_sliding_prep(head_dim=8, theta=16.0),
        "qwen35_full": qwen35_full_attention_prep(head_dim=8, theta=16.0, partial_rotary_factor=0.5),
        "qwen3": qwen3_prep(head_dim=8, theta=16.0),
    }[spec_name]
    weight = torch.full((8,), 2.0 if spec.q_norm.weight is NormWeight.W else 1.0, dtype=BF16)
    layout = KVPoolLayout(layers=1, pages=2, kv_heads=1, head_dim=8)
    pool = torch.full(layout.shape, -3.0, dtype=BF16)
    rows = PagedRows(
        positions=torch.tensor([position], dtype=torch.int32),
        seq_index=torch.tensor([0], dtype=torch.int32),
        page_table=torch.tensor([[1]], dtype=torch.int32),
    )
    out = attention_prep(spec, q, k, v, weight, weight, rows, rope_table(spec.rope, 16, BF16), pool[0])
    return out, pool[0, 1, :, position, 0]


def test_gemma4_global_v_is_the_unweighted_norm_of_the_raw_k_row() -> None:
    k = bf16([[ROW]])
    out, (k_slot, v_slot) = _single_row_prep("gemma4_global", bf16([[ROW]]), k, None, position=0)
    assert_bits(out.k[0, 0], bf16([2.0 * v for v in NORMALISED]))  # K: weight 2, position 0 turns nothing
    assert_bits(out.v[0, 0], bf16(NORMALISED))  # V: no weight, no rotation
    assert_bits(k_slot, out.k[0, 0])
    assert_bits(v_slot, out.v[0, 0])
    # At a later position K turns (pair (0, 4)) but V, taken from the raw row, does not.
    moved, _ = _single_row_prep("gemma4_global", bf16([[ROW]]), k, None, position=5)
    assert not torch.equal(moved.k, out.k)
    assert_bits(moved.v, out.v)


def test_gemma4_sliding_v_is_normalised_without_weight_and_not_rotated() -> None:
    v = bf16([[[4.0 * x for x in ROW]]])
    out, (_, v_slot) = _single_row_prep("gemma4_sliding", bf16([[ROW]]), bf16([[ROW]]), v, position=3)
    assert_bits(out.v[0, 0], bf16(NORMALISED))
    assert_bits(v_slot, bf16(NORMALISED))


def test_qwen_v_is_stored_as_given_and_qwen35_gate_passes_through() -> None:
    v = bf16([[[0.1 * x for x in X8]]])
    out, (_, v_slot) = _single_row_prep("qwen3", bf16([[ROW]]), bf16([[ROW]]), v, position=3)
    assert_bits(v_slot, v[0, 0])
    assert out.gate is None

    gate = [0.3, -1.7, 2.2, 9.0, -0.01, 5.5, 1e-3, -7.0]
    q = bf16([[ROW + gate]])  # one head of [q | gate]
    out, _ = _single_row_prep("qwen35_full", q, bf16([[ROW]]), v, position=0)
    assert out.gate is not None
    assert_bits(out.gate[0, 0], bf16(gate))
    assert_bits(out.q[0, 0], bf16([2.0 * x for x in NORMALISED]))  # stored weight 1 scales by 1 + 1


def test_round_to_is_nearest_even() -> None:
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one, 1.
    assert round_to(torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]), BF16).tolist() == [1.0, 1.0 + 2.0**-6]
