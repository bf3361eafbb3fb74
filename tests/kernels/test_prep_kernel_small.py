"""The fused Triton prep kernel against kernels.reference at small shapes (the interpreter on a CPU).

Every variant runs on a mixed batch (see ``mixed_sequences``): a prefill chunk that starts
mid-page, crosses a page boundary and ends on a partial page, decode rows at ragged positions,
scattered page ids, and a filler row on the padding page. Q/K/V are strided views of one fused
projection, as in a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from gates.harness.prep_parity import EXACT, bit_identical, compare_heads, unaddressed_unchanged
from gates.harness.prep_workload import (
    PrepBatch,
    addressed_slot_mask,
    build_batch,
    mixed_sequences,
    with_row_offset,
)
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE
from kernels.reference import (
    PagedRows,
    PrepOutputs,
    PrepSpec,
    SpecError,
    VSource,
    gemma3_prep,
    gemma4_global_prep,
    gemma4_sliding_prep,
    paged_slots,
    qwen3_prep,
    qwen35_full_attention_prep,
)
from kernels.reference import (
    attention_prep as reference_prep,
)
from kernels.triton import PrepLaunchConfig, PrepLaunchError, attention_prep

ROWS = 12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Case:
    name: str
    spec: PrepSpec
    q_heads: int
    kv_heads: int
    launch: PrepLaunchConfig = field(default_factory=PrepLaunchConfig)


CASES = [
    Case("qwen3_hd128", qwen3_prep(), 4, 2),
    # Small tiles: several Q and KV blocks per row, the last ones partly masked.
    Case("qwen3_hd128_masked_blocks", qwen3_prep(), 6, 3, PrepLaunchConfig(tile_elements=256)),
    Case("qwen35_full_hd256", qwen35_full_attention_prep(), 4, 2),
    Case("gemma4_sliding_hd256", gemma4_sliding_prep(), 4, 2),
    Case("gemma4_global_hd512_1kv", gemma4_global_prep(), 4, 1),
    Case("gemma4_global_hd512_2kv", gemma4_global_prep(), 4, 2),
    Case("gemma3_hd256_1kv", gemma3_prep(), 4, 1),
]


def make_batch(case: Case, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> PrepBatch:
    sequences, filler_rows = mixed_sequences(ROWS, seed=seed)
    return build_batch(
        case.spec,
        case.q_heads,
        case.kv_heads,
        sequences,
        filler_rows=filler_rows,
        dtype=dtype,
        device=DEVICE,
        seed=seed,
    )


def run_kernel(batch: PrepBatch, launch: PrepLaunchConfig, num_rows: int | None = None) -> PrepBatch:
    """Run the kernel on a copy of the batch's written buffers; returns that copy."""
    out = batch.clone()
    attention_prep(
        out.spec,
        out.q,
        out.k,
        out.v,
        out.q_norm_weight,
        out.k_norm_weight,
        out.rows,
        out.rope_table,
        out.pool_layer,
        out.q_out,
        out.gate_out,
        row_offset=out.row_offset,
        num_rows=num_rows,
        launch=launch,
    )
    return out


def run_reference(batch: PrepBatch) -> tuple[PrepBatch, PrepOutputs]:
    assert batch.row_offset == 0
    out = batch.clone()
    result = reference_prep(
        out.spec,
        out.q,
        out.k,
        out.v,
        out.q_norm_weight,
        out.k_norm_weight,
        out.rows,
        out.rope_table,
        out.pool_layer,
    )
    return out, result


def assert_within_tolerance(
    name: str, actual: torch.Tensor, expected: torch.Tensor, exact: bool = False
) -> None:
    report = compare_heads(name, actual, expected)
    failure = report.failure(EXACT if exact else None)
    assert failure is None, failure


@pytest.fixture(params=CASES, ids=[case.name for case in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


def test_the_batch_has_the_layout_the_tests_rely_on() -> None:
    sequences, filler_rows = mixed_sequences(ROWS)
    batch = build_batch(qwen3_prep(), 4, 2, sequences, filler_rows=filler_rows, device=DEVICE)
    slots = paged_slots(batch.rows)
    pages = (slots // PAGE_SIZE).tolist()
    chunk = sequences[0]
    chunk_pages = pages[: chunk.length]
    assert chunk.length > 1 and chunk.start_position % PAGE_SIZE != 0
    assert len(set(chunk_pages)) == 2, "the prefill chunk crosses one page boundary"
    assert chunk.end_position % PAGE_SIZE != 0, "the chunk ends on a partial page"
    used = sorted(set(pages) - {PADDING_PAGE})
    assert used != list(range(used[0], used[0] + len(used))), "page ids are scattered"
    assert filler_rows == 1 and pages[-1] == PADDING_PAGE, "the filler row writes to the padding page"
    assert len(set(batch.rows.positions[chunk.length : -1].tolist())) == len(sequences) - 1, (
        "ragged decode rows"
    )
    assert slots.unique().numel() == slots.numel(), "no two rows share a slot"


def test_kernel_matches_the_spec(case: Case) -> None:
    batch = make_batch(case)
    kernel = run_kernel(batch, case.launch)
    spec_batch, expected = run_reference(batch)

    assert_within_tolerance("q", kernel.q_out, expected.q)
    if case.spec.q_gated:
        assert kernel.gate_out is not None and expected.gate is not None
        assert_within_tolerance("gate", kernel.gate_out, expected.gate, exact=True)
    assert_within_tolerance("pool layer", kernel.pool_layer, spec_batch.pool_layer)

    slots = paged_slots(batch.rows)
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    written_k = kernel.pool_layer[pages, 0, offsets]
    written_v = kernel.pool_layer[pages, 1, offsets]
    assert_within_tolerance("k slots", written_k, expected.k)
    if case.spec.v_source is VSource.PROJECTION:
        assert batch.v is not None
        assert_within_tolerance("v slots", written_v, batch.v, exact=True)
    else:
        assert_within_tolerance("v slots", written_v, expected.v)

    # Only the addressed slots of the written layer change; the padding page takes the filler row.
    assert unaddressed_unchanged(batch.pool_layer, kernel.pool_layer, addressed_slot_mask(batch, slots))
    assert int(pages[-1]) == PADDING_PAGE and not bit_identical(
        written_k[-1], batch.pool_layer[pages[-1], 0, offsets[-1]]
    )
    other_layer = 1 - batch.layer
    assert bit_identical(kernel.pool[other_layer], batch.pool[other_layer])


def test_row_offset_gives_the_same_bits(case: Case) -> None:
    batch = make_batch(case)
    shifted = with_row_offset(batch)
    at_zero = run_kernel(batch, case.launch)
    at_one = run_kernel(shifted, case.launch)

    assert bit_identical(at_one.q_out[1:], at_zero.q_out)
    assert bit_identical(at_one.q_out[0], shifted.q_out[0]), "the sentinel output row is untouched"
    if case.spec.q_gated:
        assert at_one.gate_out is not None and at_zero.gate_out is not None and shifted.gate_out is not None
        assert bit_identical(at_one.gate_out[1:], at_zero.gate_out)
        assert bit_identical(at_one.gate_out[0], shifted.gate_out[0])
    assert bit_identical(at_one.pool, at_zero.pool), "the whole pool, every layer and page"


def test_two_runs_give_the_same_bits(case: Case) -> None:
    batch = make_batch(case)
    first = run_kernel(batch, case.launch)
    second = run_kernel(batch, case.launch)
    assert bit_identical(first.q_out, second.q_out)
    assert bit_identical(first.pool, second.pool)
    if first.gate_out is not None and second.gate_out is not None:
        assert bit_identical(first.gate_out, second.gate_out)


def test_rows_after_the_launch_are_neither_read_nor_written() -> None:
    case = CASES[2]  # gated Q: checks the gate output too
    batch = make_batch(case)
    launched = ROWS - 3
    kernel = run_kernel(batch, case.launch, num_rows=launched)
    full = run_kernel(batch, case.launch)
    assert bit_identical(kernel.q_out[:launched], full.q_out[:launched])
    assert bit_identical(kernel.q_out[launched:], batch.q_out[launched:])
    assert kernel.gate_out is not None and batch.gate_out is not None
    assert bit_identical(kernel.gate_out[launched:], batch.gate_out[launched:])
    launched_rows = PagedRows(
        batch.rows.positions[:launched], batch.rows.seq_index[:launched], batch.rows.page_table
    )
    addressed = addressed_slot_mask(batch, paged_slots(launched_rows))
    assert unaddressed_unchanged(batch.pool_layer, kernel.pool_layer, addressed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=[CASES[0].name, CASES[4].name])
def test_other_storage_dtypes_match_the_spec(case: Case, dtype: torch.dtype) -> None:
    batch = make_batch(case, dtype=dtype, seed=3)
    kernel = run_kernel(batch, case.launch)
    spec_batch, expected = run_reference(batch)
    assert_within_tolerance("q", kernel.q_out, expected.q)
    assert_within_tolerance("pool layer", kernel.pool_layer, spec_batch.pool_layer)


def test_launch_rejects_buffers_it_cannot_take() -> None:
    batch = make_batch(CASES[2])  # Qwen3.5: gated Q
    args = (batch.spec, batch.q, batch.k, batch.v, batch.q_norm_weight, batch.k_norm_weight, batch.rows)
    with pytest.raises(PrepLaunchError, match="gate_out is missing"):
        attention_prep(*args, batch.rope_table, batch.pool_layer, batch.q_out, None)
    with pytest.raises(PrepLaunchError, match="rope table"):
        attention_prep(*args, batch.rope_table[:, :, :4], batch.pool_layer, batch.q_out, batch.gate_out)
    with pytest.raises(PrepLaunchError, match="rows"):
        attention_prep(*args, batch.rope_table, batch.pool_layer, batch.q_out[:4], batch.gate_out)
    global_batch = make_batch(CASES[4])
    with pytest.raises(SpecError, match="v is given"):
        attention_prep(
            global_batch.spec,
            global_batch.q,
            global_batch.k,
            global_batch.k,
            global_batch.q_norm_weight,
            global_batch.k_norm_weight,
            global_batch.rows,
            global_batch.rope_table,
            global_batch.pool_layer,
            global_batch.q_out,
        )
