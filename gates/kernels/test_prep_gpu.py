"""GPU gates for the fused attention-prep kernel at serving sizes (manifests/kernels.toml).

The same comparisons as tests/kernels/ (which run the interpreter at toy sizes), on the GPU at
the real head counts: against kernels.reference computed on the same device, bit-exact under a
row offset, bit-exact across runs, and bit-exact when replayed from a CUDA graph. Tolerances and
their derivation: gates/harness/prep_parity.py. Each comparison prints one line of figures.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    PrepSpec,
    VSource,
    gemma4_global_prep,
    gemma4_sliding_prep,
    paged_slots,
    qwen3_prep,
    qwen35_full_attention_prep,
)
from kernels.reference import attention_prep as reference_prep
from kernels.triton import attention_prep

SERVING_ROWS = (1, 64, 256, 8192)


@dataclass(frozen=True)
class Model:
    name: str
    spec: PrepSpec
    q_heads: int
    kv_heads: int


QWEN3_4B = Model("qwen3-4b", qwen3_prep(), 32, 8)
QWEN35_4B = Model("qwen3.5-4b-full", qwen35_full_attention_prep(), 16, 4)
GEMMA4_12B_SLIDING = Model("gemma4-12b-sliding", gemma4_sliding_prep(), 16, 8)
GEMMA4_12B_GLOBAL = Model("gemma4-12b-global", gemma4_global_prep(), 16, 1)
GEMMA4_31B_GLOBAL = Model("gemma4-31b-global", gemma4_global_prep(), 32, 4)
ALL_MODELS = (QWEN3_4B, QWEN35_4B, GEMMA4_12B_SLIDING, GEMMA4_12B_GLOBAL, GEMMA4_31B_GLOBAL)


def serving_batch(model: Model, rows: int, device: torch.device, seed: int = 0) -> PrepBatch:
    sequences, filler_rows = mixed_sequences(rows, seed=seed)
    return build_batch(
        model.spec,
        model.q_heads,
        model.kv_heads,
        sequences,
        filler_rows=filler_rows,
        device=device,
        seed=seed,
    )


def run_kernel(batch: PrepBatch) -> PrepBatch:
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
    )
    torch.cuda.synchronize(out.q.device)
    return out


def check_matches_spec(model: Model, rows: int, device: torch.device) -> None:
    batch = serving_batch(model, rows, device)
    kernel = run_kernel(batch)
    spec_batch = batch.clone()
    expected = reference_prep(
        spec_batch.spec,
        spec_batch.q,
        spec_batch.k,
        spec_batch.v,
        spec_batch.q_norm_weight,
        spec_batch.k_norm_weight,
        spec_batch.rows,
        spec_batch.rope_table,
        spec_batch.pool_layer,
    )
    reports = [
        compare_heads("q", kernel.q_out, expected.q),
        compare_heads("pool layer", kernel.pool_layer, spec_batch.pool_layer),
    ]
    failures = [report.failure() for report in reports]
    if model.spec.q_gated:
        assert kernel.gate_out is not None and expected.gate is not None
        failures.append(compare_heads("gate", kernel.gate_out, expected.gate).failure(EXACT))
    slots = paged_slots(batch.rows)
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    if model.spec.v_source is VSource.PROJECTION:
        assert batch.v is not None
        failures.append(
            compare_heads("v slots", kernel.pool_layer[pages, 1, offsets], batch.v).failure(EXACT)
        )
    for report in reports:
        print(
            f"{model.name} rows={rows} {report.name}: {report.mismatched}/{report.elements} elements differ "
            f"({report.mismatch_fraction:.2e}), worst {report.worst_ulps:.2f} head-ulps"
        )
    assert [f for f in failures if f is not None] == []
    assert unaddressed_unchanged(batch.pool_layer, kernel.pool_layer, addressed_slot_mask(batch, slots))
    assert bit_identical(kernel.pool[1 - batch.layer], batch.pool[1 - batch.layer])
    if batch.filler_rows:
        assert int(pages[-1]) == PADDING_PAGE


@pytest.mark.parametrize("rows", SERVING_ROWS)
def test_qwen3_matches_spec(cuda_device: torch.device, rows: int) -> None:
    check_matches_spec(QWEN3_4B, rows, cuda_device)


@pytest.mark.parametrize("rows", SERVING_ROWS)
def test_qwen35_full_matches_spec(cuda_device: torch.device, rows: int) -> None:
    check_matches_spec(QWEN35_4B, rows, cuda_device)


@pytest.mark.parametrize("rows", SERVING_ROWS)
def test_gemma4_sliding_matches_spec(cuda_device: torch.device, rows: int) -> None:
    check_matches_spec(GEMMA4_12B_SLIDING, rows, cuda_device)


@pytest.mark.parametrize("rows", SERVING_ROWS)
@pytest.mark.parametrize("model", [GEMMA4_12B_GLOBAL, GEMMA4_31B_GLOBAL], ids=["12b-1kv", "31b-4kv"])
def test_gemma4_global_matches_spec(cuda_device: torch.device, model: Model, rows: int) -> None:
    check_matches_spec(model, rows, cuda_device)


@pytest.mark.parametrize("rows", SERVING_ROWS)
@pytest.mark.parametrize("model", ALL_MODELS, ids=[m.name for m in ALL_MODELS])
def test_row_offset_is_bit_identical(cuda_device: torch.device, model: Model, rows: int) -> None:
    batch = serving_batch(model, rows, cuda_device)
    shifted = with_row_offset(batch)
    at_zero = run_kernel(batch)
    at_one = run_kernel(shifted)
    assert bit_identical(at_one.q_out[1:], at_zero.q_out)
    assert bit_identical(at_one.q_out[0], shifted.q_out[0]), "sentinel output row written"
    if at_one.gate_out is not None and at_zero.gate_out is not None and shifted.gate_out is not None:
        assert bit_identical(at_one.gate_out[1:], at_zero.gate_out)
        assert bit_identical(at_one.gate_out[0], shifted.gate_out[0])
    assert bit_identical(at_one.pool, at_zero.pool)


@pytest.mark.parametrize("model", ALL_MODELS, ids=[m.name for m in ALL_MODELS])
def test_two_runs_are_bit_identical(cuda_device: torch.device, model: Model) -> None:
    batch = serving_batch(model, 8192, cuda_device, seed=5)
    first, second = run_kernel(batch), run_kernel(batch)
    assert bit_identical(first.q_out, second.q_out)
    assert bit_identical(first.pool, second.pool)
    if first.gate_out is not None and second.gate_out is not None:
        assert bit_identical(first.gate_out, second.gate_out)


@pytest.mark.parametrize("model", ALL_MODELS, ids=[m.name for m in ALL_MODELS])
def test_cuda_graph_replay_matches_eager(cuda_device: torch.device, model: Model) -> None:
    """Captured once, replayed after every input changed in place: the same bits as an eager run.

    This is what graph safety means for the engine: no host sync or allocation inside, and nothing
    read on the host at capture time that changes from step to step.
    """
    work = serving_batch(model, 64, cuda_device, seed=1).clone()

    def launch() -> None:
        attention_prep(
            work.spec,
            work.q,
            work.k,
            work.v,
            work.q_norm_weight,
            work.k_norm_weight,
            work.rows,
            work.rope_table,
            work.pool_layer,
            work.q_out,
            work.gate_out,
        )

    launch()  # compile outside the capture
    torch.cuda.synchronize(cuda_device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()

    # A new step with the same shapes: new activations and weights, rows reassigned to other
    # positions and sequences, page ids permuted, different pool contents.
    generator = torch.Generator().manual_seed(7)
    for tensor in (work.q, work.k, work.v, work.q_norm_weight, work.k_norm_weight, work.pool):
        if tensor is not None:
            tensor.copy_((torch.randn(tensor.shape, generator=generator) * 2.0).to(tensor.dtype))
    row_order = torch.randperm(work.rows.rows, generator=generator).to(cuda_device)
    work.rows.positions.copy_(work.rows.positions[row_order].clone())
    work.rows.seq_index.copy_(work.rows.seq_index[row_order].clone())
    pages = work.pool.shape[1]
    page_map = torch.cat((torch.tensor([PADDING_PAGE]), torch.randperm(pages - 1, generator=generator) + 1))
    work.rows.page_table.copy_(page_map.to(cuda_device)[work.rows.page_table.long()].to(torch.int32))

    eager = run_kernel(work)  # on copies of the pool and outputs, before the replay writes them
    graph.replay()
    torch.cuda.synchronize(cuda_device)
    assert bit_identical(work.q_out, eager.q_out)
    if work.gate_out is not None and eager.gate_out is not None:
        assert bit_identical(work.gate_out, eager.gate_out)
    assert bit_identical(work.pool, eager.pool)
