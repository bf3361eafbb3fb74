"""The skinny GEMM (kernels/triton/skinny_gemm.py) at small shapes: under the interpreter on a CPU,
compiled on a GPU when there is one.

The shapes are small but cut the way serving shapes are: N = 40 leaves a masked tail of 8 columns
after blocks of 16 (24 after 32); K = 208 leaves a masked tail in every K partition below (and K =
256 runs the unmasked path); split-K 3 and 4 go through the fixed-order reduce. Rows 1, 3, 17 and
64: one, a partial row block, two blocks with a ragged second, and the largest M the kernel takes.

Against the spec: within the bounds of tests/kernels/linear_bounds.py (what reordering the spec's
fp32 sum costs, measured). Metamorphic, bit for bit: row offset 1 against 0 with the sentinel rows
around the output untouched; a row alone against the same row inside a batch of 64; two runs.
Split-K 1 against split-K s: within the spec bound (a different sum order, so not bitwise).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from linear_bounds import (
    FLIP_SHARE_BOUND,
    FP32_RATIO_BOUND,
    MEASURED_FLIP_SHARE,
    MEASURED_REORDER_RATIO,
    agreement,
    measure_reordering,
)

from kernels import layer_ops, reference
from kernels.gemm import skinny_dispatch
from kernels.gemm.projections import ComposedProjections
from kernels.gemm.skinny_candidates import candidate_settings
from kernels.gemm.skinny_dispatch import (
    GATED_MAX_ROWS,
    Backend,
    ChoiceTable,
    DispatchTableError,
    ShapeChoice,
    SkinnyDispatch,
)
from kernels.reference import SpecError
from kernels.triton.fused_gemv import Fusion, fused_gemv
from kernels.triton.fused_mma import MmaSettings, fused_mma
from kernels.triton.skinny_aot import SERVING_SHAPES
from kernels.triton.skinny_gemm import MAX_ROWS, SkinnySettings, SkinnyShapeError, skinny_gemm
from kernels.triton.storage import pdl_supported

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 40, 208
ROWS = (1, 3, 17, 64)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Each K partition of K = 208 (13 × 16) ends on a masked tile:
SETTINGS = {
    "whole-s1": SkinnySettings(block_n=16, block_k=None, split_k=1),  # one [16, 256] tile
    "whole-s4": SkinnySettings(block_n=16, block_k=None, split_k=4),  # 4 × 64, the last 16 wide
    "loop-s1": SkinnySettings(block_n=32, block_k=32, split_k=1, num_stages=2),  # 7 tiles, last 16
    "loop-s3": SkinnySettings(block_n=16, block_k=32, split_k=3, num_stages=2),  # 3 + 3 + 1 tiles
    "rows-32": SkinnySettings(block_n=16, block_k=64, split_k=2, block_m=32),  # 32-row blocks
}
SPLIT_FREE = ("whole-s1", "loop-s1")


def _operands(
    m: int, dtype: torch.dtype, k: int = K, n: int = N, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x.to(DEVICE), w.to(DEVICE)


def _ids(values: tuple[object, ...]) -> list[str]:
    return [str(v).removeprefix("torch.") for v in values]


# ------------------------------------------------------------------------------- the spec and bounds


def test_spec_accumulates_in_fp32_and_rounds_once() -> None:
    # 1 + 8 · 2⁻⁹ = 1 + 2⁻⁶ is a bf16 value; summed in bf16 each 2⁻⁹ (under half an ulp of 1) is lost.
    x = torch.tensor([[1.0] + [2.0**-9] * 8], dtype=torch.bfloat16)
    w = torch.ones(1, 9, dtype=torch.bfloat16)
    assert reference.linear(x, w).item() == 1 + 2.0**-6
    # One rounding at the end: 1 + 2⁻⁸ + 2⁻¹⁶ rounds up to 1 + 2⁻⁷ (bf16), never to 1.
    x = torch.tensor([[1.0, 2.0**-8, 2.0**-16]], dtype=torch.bfloat16)
    assert reference.linear(x, torch.ones(1, 3, dtype=torch.bfloat16)).item() == 1 + 2.0**-7
    assert reference.linear(x, torch.ones(1, 3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(SpecError, match="dtype"):
        reference.linear(x, torch.ones(1, 3))


def test_the_bound_is_what_reordering_the_spec_costs() -> None:
    # The figures linear_bounds.py derives its bounds from, re-measured on the test operands: the
    # documented worst case still covers them, and the bounds keep their margin over it.
    for dtype in DTYPES:
        for k in (K, 256):
            x, w = _operands(64, dtype, k=k)
            measured = measure_reordering(x.cpu(), w.cpu())
            assert measured.ratio <= MEASURED_REORDER_RATIO, (dtype, k, measured)
            if dtype != torch.float32:
                assert measured.flip_share <= MEASURED_FLIP_SHARE[dtype], (dtype, k, measured)
    assert FP32_RATIO_BOUND >= 2.9 * MEASURED_REORDER_RATIO
    for dtype, share in MEASURED_FLIP_SHARE.items():
        assert FLIP_SHARE_BOUND[dtype] >= 7.9 * share


def test_the_bound_rejects_other_rounding_points() -> None:
    # What the bound exists to catch: bf16 accumulation, truncation instead of nearest-even.
    x, w = _operands(64, torch.bfloat16)
    spec = reference.linear(x.cpu(), w.cpu())
    exact = F.linear(x.cpu().float(), w.cpu().float())
    truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not agreement(truncated, spec, x, w).ok
    halves = [F.linear(x[:, i : i + 104].cpu().float(), w[:, i : i + 104].cpu().float()) for i in (0, 104)]
    rounded_partials = (halves[0].bfloat16().float() + halves[1].bfloat16().float()).bfloat16()
    assert not agreement(rounded_partials, spec, x, w).ok


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_matches_the_spec_within_the_reordering_bound(name: str, dtype: torch.dtype) -> None:
    for m in ROWS:
        x, w = _operands(m, dtype)
        y = skinny_gemm(x, w, SETTINGS[name])
        assert y.shape == (m, N) and y.dtype == dtype
        verdict = agreement(y, reference.linear(x.cpu(), w.cpu()), x, w)
        assert verdict.ok, f"M={m}: {verdict}"


def test_unmasked_k_and_a_full_tile_of_columns() -> None:
    x, w = _operands(17, torch.bfloat16, k=256, n=64)
    for settings in (SkinnySettings(block_k=None, split_k=4), SkinnySettings(block_n=32, block_k=64)):
        assert settings.partition(256).exact(256)
        verdict = agreement(skinny_gemm(x, w, settings), reference.linear(x.cpu(), w.cpu()), x, w)
        assert verdict.ok, f"{settings.label}: {verdict}"


# -------------------------------------------------------------------------------------- metamorphic


def _into_sentinels(
    x: torch.Tensor, w: torch.Tensor, settings: SkinnySettings, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run with x and the output ``offset`` rows into wider buffers: junk input rows around x, a row
    stride that is not K (a strided view, as a fused projection's slice is), and sentinel output rows
    and columns around the result. Returns (the written rows, whether every sentinel is unchanged)."""
    m, dtype = x.shape[0], x.dtype
    x_buf = torch.full((m + 2, K + 16), 1e4, dtype=dtype, device=DEVICE)
    x_buf[offset : offset + m, :K] = x
    sentinel = torch.full((m + 2, N + 8), -7.0, dtype=dtype, device=DEVICE)
    y_buf = sentinel.clone()
    skinny_gemm(x_buf[offset : offset + m, :K], w, settings, out=y_buf[offset : offset + m, :N])
    outside = torch.ones_like(y_buf, dtype=torch.bool)
    outside[offset : offset + m, :N] = False
    return y_buf[offset : offset + m, :N], torch.equal(y_buf[outside], sentinel[outside])


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_row_offset_one_matches_offset_zero_and_leaves_sentinels(name: str, dtype: torch.dtype) -> None:
    settings = SETTINGS[name]
    for m in ROWS:
        x, w = _operands(m, dtype)
        at_zero, kept_zero = _into_sentinels(x, w, settings, 0)
        at_one, kept_one = _into_sentinels(x, w, settings, 1)
        assert kept_zero and kept_one, f"M={m}: an element outside the output rows and columns changed"
        assert torch.equal(at_one, at_zero), f"M={m}: offset 1 differs from offset 0"
        assert torch.equal(skinny_gemm(x, w, settings), at_zero), f"M={m}: a fresh output differs"


def _rows_checked_alone(dtype: torch.dtype) -> tuple[int, ...]:
    """Every row where the arithmetic is the kernel's. Under the interpreter an fp32 ``tl.dot`` is
    numpy's matmul, which may round rows 6-11 of a 16-row tile differently from the same values at
    row 0 (tests/kernels/test_invariant_gemm.py): in fp32 on the CPU the other rows are checked."""
    if dtype != torch.float32 or torch.cuda.is_available():
        return tuple(range(MAX_ROWS))
    return tuple(r for r in range(MAX_ROWS) if r % 16 not in range(6, 12))


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_row_alone_matches_the_row_in_a_batch_of_64(name: str, dtype: torch.dtype) -> None:
    settings = SETTINGS[name]
    x, w = _operands(MAX_ROWS, dtype)
    batch = skinny_gemm(x, w, settings)
    for r in _rows_checked_alone(dtype):
        assert torch.equal(skinny_gemm(x[r : r + 1], w, settings)[0], batch[r]), f"row {r}"
    for m in ROWS:  # and the leading rows of the batch as batches of their own
        head = skinny_gemm(x[:m], w, settings)
        rows = [r for r in _rows_checked_alone(dtype) if r < m]
        assert torch.equal(head[rows], batch[:m][rows]), f"first {m} rows"


@pytest.mark.parametrize("name", list(SETTINGS))
def test_two_runs_are_identical(name: str) -> None:
    for dtype in DTYPES:
        x, w = _operands(17, dtype)
        first = skinny_gemm(x, w, SETTINGS[name])
        assert torch.equal(skinny_gemm(x, w, SETTINGS[name]), first), dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_split_k_agrees_with_no_split_within_the_spec_bound(dtype: torch.dtype) -> None:
    for m in ROWS:
        x, w = _operands(m, dtype)
        for base in SPLIT_FREE:
            unsplit = skinny_gemm(x, w, SETTINGS[base])
            for name, settings in SETTINGS.items():
                if settings.split_k > 1:
                    verdict = agreement(skinny_gemm(x, w, settings), unsplit, x, w)
                    assert verdict.ok, f"M={m}: {name} against {base}: {verdict}"


def test_empty_batch() -> None:
    x, w = _operands(1, torch.bfloat16)
    assert skinny_gemm(x[:0], w, SETTINGS["whole-s4"]).shape == (0, N)


# --------------------------------------------------------------------------------------- refusals


def test_refusals_name_the_shape() -> None:
    x, w = _operands(65, torch.bfloat16)
    settings = SETTINGS["whole-s1"]
    with pytest.raises(SkinnyShapeError, match=r"x \[65, 208\] @ w \[40, 208\].*M=65.*at most 64"):
        skinny_gemm(x, w, settings)
    with pytest.raises(SkinnyShapeError, match=r"\[3, 200\].*K=200 is not a multiple of 16"):
        skinny_gemm(x[:3, :200], w[:, :200].contiguous(), settings)
    with pytest.raises(SkinnyShapeError, match="dtypes"):
        skinny_gemm(x[:3], w.float(), settings)
    with pytest.raises(SkinnyShapeError, match="last dim has stride 2"):
        skinny_gemm(x[:3, ::2], w[:, :104].contiguous(), settings)
    with pytest.raises(SkinnyShapeError, match="weight must be contiguous"):
        skinny_gemm(x[:3], torch.cat([w, w], dim=1)[:, :K], settings)
    big_k = torch.zeros(40, 4096, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(SkinnyShapeError, match=r"\[16, 4096\] holds 65536 elements"):
        skinny_gemm(torch.zeros(1, 4096, dtype=torch.bfloat16, device=DEVICE), big_k, settings)
    with pytest.raises(SkinnyShapeError, match="leaves the last of split_k=6 splits empty"):
        skinny_gemm(x[:3], w, SkinnySettings(block_k=None, split_k=6))
    with pytest.raises(SkinnyShapeError, match="block_k=24"):
        SkinnySettings(block_k=24)


def test_settings_round_trip_through_json() -> None:
    for settings in SETTINGS.values():
        assert SkinnySettings.from_json(settings.to_json()) == settings
    with pytest.raises(SkinnyShapeError, match="unknown field"):
        SkinnySettings.from_json({"block_n": 16, "blockk": 64})


def test_pdl_is_never_used_on_the_cpu_or_under_the_interpreter() -> None:
    assert not pdl_supported(torch.device("cpu"))


def test_infer_pdl_0_turns_pdl_off_where_the_device_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.triton import storage

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(storage, "_capability_has_pdl", lambda index: True)
    monkeypatch.setattr(storage, "_triton_has_pdl", lambda: True)
    assert pdl_supported(torch.device("cuda", 0))
    monkeypatch.setenv("INFER_PDL", "0")
    assert not pdl_supported(torch.device("cuda", 0))


def test_every_candidate_of_every_serving_shape_is_runnable_and_m_free() -> None:
    for n, k in SERVING_SHAPES:
        candidates = candidate_settings(n, k)
        assert candidates, (n, k)
        for settings in candidates:
            assert settings.problem(n, k) is None, (n, k, settings)


# --------------------------------------------------------------------------------------- dispatch


def _table(
    settings: SkinnySettings,
    rows: tuple[tuple[int, Backend], ...],
    mma: tuple[tuple[int, MmaSettings], ...] = (),
) -> ChoiceTable:
    return ChoiceTable(shapes=(ShapeChoice(N, K, "bfloat16", settings, rows, mma),))


# Not the MMA's default for [40, 208] (block_n 16, block_k 256): the dispatch must pass these on.
MMA = MmaSettings(block_n=32, block_k=64, num_stages=2)


def test_dispatch_routes_a_table_entry_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[SkinnySettings] = []

    def spy(x: torch.Tensor, w: torch.Tensor, settings: SkinnySettings) -> torch.Tensor:
        calls.append(settings)
        return skinny_gemm(x, w, settings)

    monkeypatch.setattr(skinny_dispatch, "skinny_gemm", spy)
    settings = SETTINGS["whole-s4"]
    linear = SkinnyDispatch(_table(settings, ((1, Backend.OURS), (8, Backend.CUBLAS), (64, Backend.OURS))))
    x, w = _operands(17, torch.bfloat16)
    assert torch.equal(linear(x[:1], w), skinny_gemm(x[:1], w, settings))
    assert torch.equal(linear(x, w), skinny_gemm(x, w, settings))  # 17 rows: bucket 64, ours
    assert calls == [settings, settings]
    assert torch.equal(linear(x[:3], w), F.linear(x[:3], w))  # 3 rows: bucket 8, cuBLAS
    assert len(calls) == 2
    three_d = linear(x[:16].reshape(2, 8, K), w)
    assert three_d.shape == (2, 8, N)


def test_dispatch_routes_a_gemv_bucket_to_the_decode_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def spy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return fused_gemv(x, w)

    monkeypatch.setattr(skinny_dispatch, "fused_gemv", spy)
    linear = SkinnyDispatch(_table(SETTINGS["whole-s4"], ((2, Backend.GEMV), (8, Backend.OURS))))
    x, w = _operands(8, torch.bfloat16)
    assert torch.equal(linear(x[:2], w), fused_gemv(x[:2], w))
    assert torch.equal(linear(x[:1], w), fused_gemv(x[:1], w))
    assert calls == [2, 1]
    assert torch.equal(linear(x[:3], w), skinny_gemm(x[:3], w, SETTINGS["whole-s4"]))  # bucket 8
    assert calls == [2, 1]


def test_the_gated_activation_rides_the_gemv_where_the_table_sends_the_gate_up_to_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Where the bucket is the GEMV and M is at most ``GATED_MAX_ROWS``, ``linear_gated`` is the GEMV
    with its gated epilogue (one launch) and the composed projections take it; elsewhere it
    declines and they compose; a weight the epilogue refuses (odd N: no gate and up halves)
    declines by name, once."""
    linear = SkinnyDispatch(_table(SETTINGS["whole-s4"], ((2, Backend.GEMV), (8, Backend.OURS))))
    projections = ComposedProjections(linear)
    silu = reference.GatedActivation.SILU
    x, w = _operands(8, torch.bfloat16)
    fused = fused_gemv(x[:1], w, Fusion(activation=silu))
    assert torch.equal(linear.linear_gated(x[:1], w, silu), fused)
    assert torch.equal(projections.norm_linear_gated(x[:1], None, None, w, silu), fused)
    # Two rows: past GATED_MAX_ROWS, so the plain GEMV, then SiLU·mul.
    assert GATED_MAX_ROWS == 1
    assert linear.linear_gated(x[:2], w, silu) is None
    composed = layer_ops.gated_activation(fused_gemv(x[:2], w, Fusion()), silu)
    assert torch.equal(projections.norm_linear_gated(x[:2], None, None, w, silu), composed)
    assert linear.linear_gated(x[:3], w, silu) is None  # bucket 8: the skinny GEMM
    composed = layer_ops.gated_activation(skinny_gemm(x[:3], w, SETTINGS["whole-s4"]), silu)
    assert torch.equal(projections.norm_linear_gated(x[:3], None, None, w, silu), composed)
    assert linear.linear_gated(x[:1, : K - 16], w[:, : K - 16], silu) is None  # no entry for [40, 192]

    odd = SkinnyDispatch(
        ChoiceTable(shapes=(ShapeChoice(N - 1, K, "bfloat16", SETTINGS["whole-s4"], ((2, Backend.GEMV),)),))
    )
    with caplog.at_level(logging.WARNING, logger="infer.gemm"):
        assert odd.linear_gated(x[:1], w[: N - 1], silu) is None
        assert odd.linear_gated(x[:2], w[: N - 1], silu) is None
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 1 and "[39, 208]" in refusals[0] and "odd" in refusals[0], refusals


def test_a_gemv_bucket_past_the_gemv_s_rows_is_refused_by_name() -> None:
    with pytest.raises(DispatchTableError, match=r"\[40, 208\] bfloat16: row counts \[8\] choose the GEMV"):
        _table(SETTINGS["whole-s4"], ((1, Backend.GEMV), (8, Backend.GEMV)))


def test_dispatch_routes_an_mma_bucket_through_the_fused_mma(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[tuple[int, Fusion, MmaSettings]] = []

    def spy(x: torch.Tensor, w: torch.Tensor, fusion: Fusion, settings: MmaSettings) -> torch.Tensor:
        calls.append((x.shape[0], fusion, settings))
        return fused_mma(x, w, fusion, settings)

    monkeypatch.setattr(skinny_dispatch, "fused_mma", spy)
    rows = ((4, Backend.OURS), (16, Backend.MMA), (64, Backend.CUBLAS))
    linear = SkinnyDispatch(_table(SETTINGS["whole-s4"], rows, ((16, MMA),)))
    x, w = _operands(17, torch.bfloat16)
    for m in (5, 16):  # bucket 16: the MMA with the bucket's settings, bit for bit a direct call
        assert torch.equal(linear(x[:m], w), fused_mma(x[:m], w, Fusion(), MMA)), m
    assert calls == [(5, Fusion(), MMA), (16, Fusion(), MMA)]
    assert torch.equal(linear(x[:4], w), skinny_gemm(x[:4], w, SETTINGS["whole-s4"]))  # bucket 4
    assert torch.equal(linear(x, w), F.linear(x, w))  # 17 rows: bucket 64, cuBLAS
    assert len(calls) == 2
    assert linear(x[:12].reshape(2, 6, K), w).shape == (2, 6, N)
    # Settings the kernel refuses (the pipeline past its shared memory): F.linear, said by name.
    too_big = MmaSettings(block_n=64, block_k=512)
    refused = SkinnyDispatch(_table(SETTINGS["whole-s4"], ((16, Backend.MMA),), ((16, too_big),)))
    with caplog.at_level(logging.WARNING, logger="infer.gemm"):
        assert torch.equal(refused(x[:8], w), F.linear(x[:8], w))
    assert any(
        "[40, 208] bfloat16" in r.getMessage() and "shared memory" in r.getMessage() for r in caplog.records
    )


def test_an_mma_bucket_past_the_mma_s_rows_or_without_its_settings_is_refused_by_name() -> None:
    rows = ((8, Backend.MMA), (65, Backend.MMA))
    with pytest.raises(
        DispatchTableError,
        match=r"\[40, 208\] bfloat16: row counts \[65\] choose the MMA, which takes at most 64",
    ):
        _table(SETTINGS["whole-s4"], rows, ((8, MMA), (65, MMA)))
    with pytest.raises(DispatchTableError, match=r"\[40, 208\] bfloat16: MMA settings for row counts \[8\]"):
        _table(SETTINGS["whole-s4"], ((8, Backend.MMA), (16, Backend.MMA)), ((8, MMA),))
    with pytest.raises(
        DispatchTableError, match=r"row counts \[8\], but the row counts choosing the MMA are \[\]"
    ):
        _table(SETTINGS["whole-s4"], ((8, Backend.OURS),), ((8, MMA),))
    # Two settings in one row block (8 and 16 rows both run 16-row blocks) would break invariance.
    other = MmaSettings(block_n=16, block_k=64, num_stages=2)
    with pytest.raises(DispatchTableError, match=r"row count 16 .* 16-row block .* one per row block"):
        _table(SETTINGS["whole-s4"], ((8, Backend.MMA), (16, Backend.MMA)), ((8, MMA), (16, other)))
    mixed = _table(SETTINGS["whole-s4"], ((16, Backend.MMA), (64, Backend.MMA)), ((16, MMA), (64, other)))
    assert mixed.shapes[0].mma_settings(64) == other  # different row blocks may differ


def test_dispatch_falls_back_by_name_once_per_shape(caplog: pytest.LogCaptureFixture) -> None:
    linear = SkinnyDispatch(_table(SETTINGS["whole-s1"], ((1, Backend.OURS), (8, Backend.OURS))))
    x, w = _operands(17, torch.bfloat16)
    other = torch.randn(24, K, dtype=torch.bfloat16, device=DEVICE)
    with caplog.at_level(logging.INFO, logger="infer.gemm"):
        assert torch.equal(linear(x, other), F.linear(x, other))
        assert torch.equal(linear(x, other), F.linear(x, other))
        assert torch.equal(linear(x, w), F.linear(x, w))  # 17 rows: beyond the largest bucket, 8
    messages = [r.getMessage() for r in caplog.records]
    assert sum("[24, 208] bfloat16" in m and "no entry" in m for m in messages) == 1, messages
    assert sum("[40, 208] bfloat16" in m and "M=17" in m for m in messages) == 1, messages


def test_dispatch_table_round_trips_through_a_file(tmp_path: Path) -> None:
    table = _table(SETTINGS["loop-s3"], ((1, Backend.OURS), (64, Backend.CUBLAS)))
    path = tmp_path / "dispatch.json"
    table.save(path)
    loaded = ChoiceTable.load(path)
    assert loaded == table
    assert loaded.lookup(N, K, torch.bfloat16) == table.shapes[0]
    assert loaded.lookup(N, K, torch.float16) is None
    other = ChoiceTable(shapes=(ShapeChoice(N, 256, "bfloat16", SETTINGS["whole-s1"], ((1, Backend.OURS),)),))
    merged = ChoiceTable.merged([loaded, other])
    assert merged.lookup(N, K, torch.bfloat16) == table.shapes[0]
    assert merged.lookup(N, 256, torch.bfloat16) == other.shapes[0]
    with pytest.raises(DispatchTableError, match=r"\[40, 208\] bfloat16 twice"):
        ChoiceTable.merged([loaded, table])
    assert "mma_settings" not in path.read_text()  # a table without "mma" reads as before it
    path.write_text(path.read_text().replace('"ours"', '"triton"'))
    with pytest.raises(DispatchTableError, match="triton"):
        ChoiceTable.load(path)


def test_an_mma_table_round_trips_through_a_file(tmp_path: Path) -> None:
    rows = ((1, Backend.GEMV), (8, Backend.MMA), (16, Backend.MMA), (64, Backend.CUBLAS))
    table = _table(SETTINGS["loop-s3"], rows, ((8, MMA), (16, MMA)))
    path = tmp_path / "dispatch.json"
    table.save(path)
    saved = json.loads(path.read_text())["shapes"][0]
    assert saved["rows"] == {"1": "gemv", "8": "mma", "16": "mma", "64": "cublas"}
    block = {"block_n": 32, "block_k": 64, "num_stages": 2, "num_warps": 4, "pdl": True}
    assert saved["mma_settings"] == {"8": block, "16": block}
    loaded = ChoiceTable.load(path)
    assert loaded == table
    choice = loaded.lookup(N, K, torch.bfloat16)
    assert choice is not None and choice.backend(12) == (16, Backend.MMA) and choice.mma_settings(16) == MMA
    for broken, why in (
        ({**block, "block_k": "64"}, "block_k='64' must be an integer"),
        ({"block_n": 32}, "fields"),
    ):
        entry = {**saved, "mma_settings": {"8": block, "16": broken}}
        path.write_text(json.dumps({"format": skinny_dispatch.TABLE_FORMAT, "shapes": [entry]}))
        with pytest.raises(DispatchTableError, match=why):
            ChoiceTable.load(path)


# ----------------------------------------------------------------------------- sm_90 compile check


def test_every_candidate_compiles_for_sm90_with_pdl_and_16_byte_loads() -> None:
    # The interpreter accepts programs the GPU compiler rejects and cannot show the PTX: compile each
    # candidate at the serving shapes in a child process (this session interprets).
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "kernels.triton.skinny_aot"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == sum(len(candidate_settings(n, k)) for n, k in SERVING_SHAPES), result.stdout


# ------------------------------------------------------ GPU only: serving shapes, graphs and PDL

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 2560), (2560, 9728), (3840, 15360)], ids=["qkv", "down", "g-down"]
)
def test_gpu_serving_shapes_are_batch_invariant_and_within_the_bound(n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(MAX_ROWS, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    for settings in candidate_settings(n, k):
        full = skinny_gemm(x, w, settings)
        for m in (1, 2, 3, 8, 17, 33, 63):
            assert torch.equal(skinny_gemm(x[:m], w, settings), full[:m]), f"{settings.label}: first {m} rows"
        assert torch.equal(skinny_gemm(x[40:41], w, settings)[0], full[40]), settings.label
        verdict = agreement(full, reference.linear(x.cpu(), w.cpu()), x, w)
        # On the tensor cores, per element only: their in-group rounding is the hardware's, so the
        # share of bf16 flips is reported, not held to the interpreter-measured figure.
        assert verdict.worst_excess <= 1.0, f"{settings.label}: {verdict}"
        print(f"[{n}, {k}] {settings.label}: {verdict}")


@needs_cuda
def test_gpu_graph_replay_with_pdl_matches_eager() -> None:
    assert pdl_supported(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
    x = torch.randn(8, 2560, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(2560, 2560, device="cuda", dtype=torch.bfloat16) / 50 for _ in range(4)]
    settings = candidate_settings(2560, 2560)[0]
    assert settings.pdl and settings.split_k > 1

    def chain() -> torch.Tensor:
        h = x
        for w in ws:  # each GEMM reads the previous one's output: PDL must wait for it
            h = skinny_gemm(h, w, settings)
        return h

    eager = chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
