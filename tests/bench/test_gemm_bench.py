"""`infer bench gemm` on the CPU: the shape table, the bytes behind every floor, the options, the
choice of settings and of backends, the refusal without a GPU, and one whole run with the device
timer replaced (the kernels themselves run under the interpreter)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import typer
from typer.testing import CliRunner

from infer_cli.bench import gemm_cmd, gemm_timing
from infer_cli.bench.gemm_cmd import parse_gemm_rows, parse_models
from infer_cli.bench.gemm_timing import (
    GemmBenchPlan,
    GemmTiming,
    Projection,
    chain_bytes,
    chain_copies,
    choose_settings,
    decode_chain,
    dispatch_table,
    gemm_bench_plan,
    gemm_bytes,
    model_projections,
    saved_dispatch_table,
)
from infer_cli.main import app
from kernels.gemm.skinny_dispatch import MEASURED_TABLES, Backend, ChoiceTable, measured_table
from kernels.triton import fused_gemv as fused_module
from kernels.triton import fused_mma as mma_module
from kernels.triton import skinny_gemm as skinny_module
from kernels.triton.skinny_gemm import SkinnySettings

MIB = 1 << 20


def _shapes(model: str) -> list[tuple[str, int, int, int]]:
    return [(p.name, p.n, p.k, p.per_step) for p in model_projections(model)]


def test_qwen3_4b_projection_shapes() -> None:
    # hidden 2560, q 32·128 = 4096, kv 8·128 = 1024, intermediate 9728, vocab 151936, 36 layers.
    assert _shapes("qwen3-4b") == [
        ("qkv", 6144, 2560, 36),
        ("o", 2560, 4096, 36),
        ("gate-up", 19456, 2560, 36),
        ("down", 2560, 9728, 36),
        ("lm-head", 151936, 2560, 1),
    ]


def test_gemma4_12b_projection_shapes_come_from_the_preset() -> None:
    # hidden 3840, 16 heads; sliding: head dim 256, 8 KV heads; global: head dim 512, one K = V head
    # (no V projection); intermediate 15360; vocab 262144; 48 layers, every sixth global.
    assert _shapes("gemma4-12b") == [
        ("qkv", 8192, 3840, 40),
        ("o", 3840, 4096, 40),
        ("qk-global", 8704, 3840, 8),
        ("o-global", 3840, 8192, 8),
        ("gate-up", 30720, 3840, 48),
        ("down", 3840, 15360, 48),
        ("lm-head", 262144, 3840, 1),
    ]


def test_qwen35_projection_shapes_are_the_weights_the_model_line_multiplies(tiny_qwen35: Path) -> None:
    """Held to the line's own weights (the tiny preset through the real loader), not to numbers
    written here: every 2-D weight a decode step multiplies, with how many steps multiply it."""
    from engine.config import EngineConfig
    from models.registry import ModelOptions, load_model

    loaded = load_model(str(tiny_qwen35), ModelOptions(engine=EngineConfig(num_kv_pages=8), device="cpu"))
    model = loaded.scheduler.runner.model  # type: ignore[attr-defined]
    weights: dict[tuple[int, int], int] = {}
    for layer in model.layers:
        mixer = layer.mixer
        pair = (mixer.in_proj, mixer.out) if hasattr(mixer, "in_proj") else (mixer.qkv, mixer.o)
        for w in (*pair, layer.gate_up, layer.down):
            weights[tuple(w.shape)] = weights.get(tuple(w.shape), 0) + 1
    weights[tuple(model.lm_head.shape)] = weights.get(tuple(model.lm_head.shape), 0) + 1
    bench: dict[tuple[int, int], int] = {}
    for p in gemm_timing.qwen35_projections("tiny"):
        bench[p.shape] = bench.get(p.shape, 0) + p.per_step
    assert bench == weights
    # The 4B: 24 GDN layers (in_proj 2·16·128 + 2·32·128 + 2·32 = 12352), 8 gated attention layers
    # (QKV 2·16·256 + 2·4·256 = 10240), intermediate 9216, vocab 248320 (tied: the embedding).
    assert [(p.name, p.n, p.k, p.per_step) for p in model_projections("qwen35-4b")] == [
        ("in-proj", 12352, 2560, 24),
        ("out-proj", 2560, 4096, 24),
        ("qkv", 10240, 2560, 8),
        ("o", 2560, 4096, 8),
        ("gate-up", 18432, 2560, 32),
        ("down", 2560, 9216, 32),
        ("lm-head", 248320, 2560, 1),
    ]
    chain = decode_chain("qwen35-4b")
    assert [p.name for p in chain[:8]] == ["in-proj", "out-proj", "gate-up", "down"] * 2
    assert [p.name for p in chain[12:16]] == ["qkv", "o", "gate-up", "down"] and chain[-1].name == "lm-head"


def test_decode_chains_hold_every_projection_of_every_layer_once_in_model_order() -> None:
    qwen = decode_chain("qwen3-4b")
    assert len(qwen) == 36 * 4 + 1
    assert [p.name for p in qwen[:5]] == ["qkv", "o", "gate-up", "down", "qkv"]
    assert qwen[-1].name == "lm-head"
    gemma = decode_chain("gemma4-12b")
    assert len(gemma) == 48 * 4 + 1
    attention = [p.name for p in gemma[::4][:48]]
    assert [i for i, name in enumerate(attention) if name == "qk-global"] == [5, 11, 17, 23, 29, 35, 41, 47]
    for model in gemm_timing.MODEL_NAMES:
        counts = {p.name: p.per_step for p in model_projections(model)}
        assert {name: sum(p.name == name for p in decode_chain(model)) for name in counts} == counts


def test_bytes_count_the_weight_and_the_activations_once() -> None:
    assert gemm_bytes(6144, 2560, 1) == (6144 * 2560 + 2560 + 6144) * 2
    assert gemm_bytes(2560, 9728, 64) == (2560 * 9728 + 64 * 9728 + 64 * 2560) * 2
    # Qwen3-4B's weights per decode step, 8.04 GB (perf-notes' "bytes/step"), plus x and y per GEMM.
    weights = 2 * (36 * (6144 * 2560 + 2560 * 4096 + 19456 * 2560 + 2560 * 9728) + 151936 * 2560)
    assert weights == 8_044_544_000
    chain = decode_chain("qwen3-4b")
    assert chain_bytes(chain, 1) == weights + 2 * sum(p.k + p.n for p in chain)


def test_chain_copies_exceed_four_l2s_and_at_least_eight() -> None:
    l2 = 50 * MIB
    assert chain_copies(2560 * 4096 * 2, l2) == 10  # O projection, 21 MB
    assert chain_copies(6144 * 2560 * 2, l2) == 8  # QKV, 31 MB: 6.7 would do, 8 is the floor
    assert chain_copies(151936 * 2560 * 2, l2) == 8
    for n, k in ((2560, 4096), (6144, 2560), (3840, 4096)):
        assert chain_copies(n * k * 2, l2) * n * k * 2 >= 4 * l2


# ------------------------------------------------------------------------------------------ options


def test_model_option() -> None:
    assert parse_models("all") == ("qwen3-4b", "gemma4-12b", "qwen35-4b")
    assert parse_models("gemma4-12b") == ("gemma4-12b",)
    with pytest.raises(typer.BadParameter, match="llama"):
        parse_models("llama")


def test_rows_option() -> None:
    assert parse_gemm_rows(None) == (1, 2, 4, 8, 16, 32, 64)
    assert parse_gemm_rows("1,8,64") == (1, 8, 64)
    assert parse_gemm_rows("64, 1,1") == (1, 64)
    for bad in ("0", "65", "1,x", ""):
        with pytest.raises(typer.BadParameter):
            parse_gemm_rows(bad)
    assert gemm_cmd.MAX_ROWS == skinny_module.MAX_ROWS
    assert gemm_cmd.MODEL_CHOICES == gemm_timing.MODEL_NAMES


def test_bad_options_are_refused_before_looking_for_a_gpu() -> None:
    result = CliRunner().invoke(app, ["bench", "gemm", "--rows", "1,128"])
    assert result.exit_code == 2
    assert "1..64" in result.output


def test_without_a_gpu_the_command_refuses_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["bench", "gemm"])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output


def test_the_plan_measures_each_shape_once() -> None:
    plan = gemm_bench_plan(("qwen3-4b", "gemma4-12b"), (1, 8, 64))
    assert len(plan.projections) == 12
    assert [model for model, _ in plan.chains] == ["qwen3-4b", "gemma4-12b"]
    assert gemm_bench_plan(("qwen3-4b",), (1,), chains=False).chains == ()
    with pytest.raises(ValueError, match=r"1\.\.64"):
        gemm_bench_plan(("qwen3-4b",), (65,))


# --------------------------------------------------------------------------- choices from timings


def test_one_setting_per_shape_by_mean_time_over_floor() -> None:
    fast_small = SkinnySettings(block_k=None, split_k=4)
    fast_large = SkinnySettings(block_k=64)
    floors = {1: 10.0, 64: 100.0}
    # Mean time over floor, not total time: 1.0× and 1.3× the floor (mean 1.15, 140 µs in all) beats
    # 2.0× and 1.0× (mean 1.5, 120 µs in all), so batch 1 is not drowned by batch 64's longer time.
    times = {fast_small: {1: 10.0, 64: 130.0}, fast_large: {1: 20.0, 64: 100.0}}
    assert choose_settings(times, floors) == fast_small
    times = {fast_small: {1: 10.0, 64: 160.0}, fast_large: {1: 15.0, 64: 100.0}}  # 1.3 against 1.25
    assert choose_settings(times, floors) == fast_large


def test_the_dispatch_table_takes_the_faster_backend_per_row_count() -> None:
    settings = SkinnySettings(block_k=None, split_k=5)
    timings = [
        GemmTiming(
            "m", "qkv", 6144, 2560, 1, cublas_us=10.0, ours_us=8.0, floor_us=7.0, settings=settings.label
        ),
        GemmTiming(
            "m", "qkv", 6144, 2560, 64, cublas_us=10.0, ours_us=12.0, floor_us=8.0, settings=settings.label
        ),
    ]
    table = dispatch_table([((6144, 2560), settings)], timings, "bfloat16")
    choice = table.lookup(6144, 2560, torch.bfloat16)
    assert choice is not None and choice.settings == settings
    assert choice.rows == ((1, Backend.OURS), (64, Backend.CUBLAS))


def test_the_gemv_is_chosen_where_it_was_timed_fastest() -> None:
    settings = SkinnySettings(block_k=None, split_k=5)

    def timing(rows: int, fused_us: float | None) -> GemmTiming:
        return GemmTiming(
            "m", "o", 2560, 4096, rows, cublas_us=10.0, ours_us=9.0, floor_us=7.0,
            settings=settings.label, fused_us=fused_us,
        )  # fmt: skip

    timings = [timing(1, 8.0), timing(2, 9.5), timing(8, None)]
    assert [t.winner for t in timings] == [Backend.GEMV, Backend.OURS, Backend.OURS]
    table = dispatch_table([((2560, 4096), settings)], timings, "bfloat16")
    choice = table.lookup(2560, 4096, torch.bfloat16)
    assert choice is not None
    assert choice.rows == ((1, Backend.GEMV), (2, Backend.OURS), (8, Backend.OURS))


def test_the_mma_is_chosen_only_where_it_was_timed_strictly_fastest() -> None:
    settings = SkinnySettings(block_k=None, split_k=5)
    kept = {16: mma_module.MmaSettings(block_n=32, block_k=128), 64: mma_module.MmaSettings(block_n=64)}

    def timing(rows: int, mma_us: float | None, label: bool = True) -> GemmTiming:
        return GemmTiming(
            "m", "qkv", 6144, 2560, rows, cublas_us=15.6, ours_us=17.5, floor_us=10.0,
            settings=settings.label, fused_us=14.0 if rows <= 4 else None, mma_us=mma_us,
            mma_settings=kept[mma_module.row_block(rows)].label if mma_us is not None and label else None,
        )  # fmt: skip

    # M = 8 and 16: the MMA fastest; 32: slower than cuBLAS; 64: level with cuBLAS (a tie is not a
    # win); 1: not timed (the GEMV's rows).
    timings = [timing(1, None), timing(8, 14.9), timing(16, 14.8), timing(32, 15.7), timing(64, 15.6)]
    winners = [Backend.GEMV, Backend.MMA, Backend.MMA, Backend.CUBLAS, Backend.CUBLAS]
    assert [t.winner for t in timings] == winners
    choice = dispatch_table([((6144, 2560), settings)], timings, "bfloat16").lookup(
        6144, 2560, torch.bfloat16
    )
    assert choice is not None and choice.rows == tuple(zip((1, 8, 16, 32, 64), winners, strict=True))
    assert choice.mma == ((8, kept[16]), (16, kept[16]))
    # Fastest at 64 rows too: the 64-row block's settings for that bucket.
    choice = dispatch_table(
        [((6144, 2560), settings)], [timing(16, 14.8), timing(64, 15.0)], "bfloat16"
    ).shapes[0]
    assert choice.mma == ((16, kept[16]), (64, kept[64]))
    # A time without the settings it was taken with cannot be dispatched: not a candidate.
    assert timing(8, 1.0, label=False).winner is Backend.CUBLAS


def test_mma_settings_labels_parse_back() -> None:
    for block in mma_module.ROW_BLOCKS:
        for settings in mma_module.mma_candidates(6144, 2560, block):
            assert mma_module.MmaSettings.from_label(settings.label) == settings
    with pytest.raises(mma_module.FusedMmaError, match="n32·k128x4·w4"):
        mma_module.MmaSettings.from_label("n32·k128x4·w4")


def test_a_saved_result_gives_the_table_its_run_wrote_and_the_shipped_mma_rows() -> None:
    # Every "mma" row of a shipped table is what `dispatch_table` chose from a saved run named in
    # its `measured_at`, with the settings that run kept; and the 15a67ed Qwen3-4B run chooses it
    # for QKV at 8 and 16 rows with [32, 128] × 4 (the MMA's default rule gives 256-wide K tiles).
    data = Path(__file__).resolve().parents[2] / "docs/benchmarks/data"
    saved = {path.name: json.loads(path.read_text()) for path in sorted(data.glob("*-gemm-*.json"))}
    qwen3 = saved_dispatch_table(saved["2026-12-05-gemm-qwen3-4b-h100-15a67ed.json"])
    qkv = qwen3.lookup(6144, 2560, torch.bfloat16)
    measured = mma_module.MmaSettings(block_n=32, block_k=128, num_stages=4)
    assert qkv is not None and qkv.mma == ((8, measured), (16, measured))
    assert mma_module.mma_settings(6144, 2560, 16) != measured
    down = qwen3.lookup(2560, 9728, torch.bfloat16)
    assert down is not None and Backend.MMA not in {b for _, b in down.rows}
    shipped_mma = 0
    for device in MEASURED_TABLES:
        table = measured_table(device)
        assert table is not None
        runs = [saved_dispatch_table(r) for r in saved.values() if r.get("device") == device]
        for choice in table.shapes:
            if not choice.mma:
                continue
            shipped_mma += len(choice.mma)
            sources = [r for r in runs if r.measured_at in table.measured_at]
            chosen = [c for r in sources if (c := r.lookup(choice.n, choice.k, torch.bfloat16)) is not None]
            assert any(c.mma == choice.mma for c in chosen), (device, choice.n, choice.k)
    assert shipped_mma > 0


# ------------------------------------------------------------------- a whole run, timer replaced


def _fake_cost(call: Callable[[], object]) -> float:
    """µs a fake device charges: cuBLAS 10; ours 5 with PDL, 9 without; the dispatch 6; fused 4;
    the fused MMA 3 with its default settings, 3.5 with any other candidate."""
    assert isinstance(call, partial)
    if call.func is F.linear:
        return 10.0
    if isinstance(call.func, gemm_timing.SkinnyDispatch):
        return 6.0
    if call.func is fused_module.fused_gemv:
        return 4.0
    if call.func is mma_module.fused_mma:
        x, w = call.args[:2]
        settings = call.args[3] if len(call.args) > 3 else None
        default = mma_module.mma_settings(w.shape[0], w.shape[1], mma_module.row_block(x.shape[0]))
        return 3.0 if settings in (None, default) else 3.5
    settings = call.args[2]
    assert isinstance(settings, SkinnySettings)
    return 5.0 if settings.pdl else 9.0


def _fake_graph_us(calls: Sequence[Callable[[], object]]) -> float:
    first = calls[0]
    assert isinstance(first, partial)
    settings = first.args[2] if len(first.args) > 2 else None
    if isinstance(settings, SkinnySettings) and not settings.pdl and first.args[1].shape == (40, 208):
        raise RuntimeError("out of resources (a fake failure)")
    for call in (calls[0], calls[-1]):
        call()  # the real kernels, under the interpreter
    return sum(_fake_cost(call) for call in calls)


def test_a_whole_run_with_the_device_timer_replaced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a = Projection("tiny", "a", 48, 64, 2)
    b = Projection("tiny", "b", 40, 208, 1)
    plan = GemmBenchPlan(rows=(1, 8), projections=(a, b), chains=(("tiny", (a, b, a)),))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gemm_timing, "cuda_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(gemm_timing, "device_facts", lambda device: ("fake device", MIB))
    monkeypatch.setattr(gemm_timing, "copy_bandwidth", lambda device: 1000.0)
    monkeypatch.setattr(gemm_timing, "graph_us", _fake_graph_us)
    monkeypatch.setattr(gemm_timing, "gemm_bench_plan", lambda models, rows, chains: plan)
    result_file, dispatch_file = tmp_path / "gemm.json", tmp_path / "dispatch.json"
    partial_saves: list[bool] = []
    save = gemm_timing.GemmBenchResult.to_json

    def counting_save(self: gemm_timing.GemmBenchResult) -> dict[str, object]:
        partial_saves.append(self.complete)
        return save(self)

    monkeypatch.setattr(gemm_timing.GemmBenchResult, "to_json", counting_save)
    run = CliRunner().invoke(
        app,
        [
            "bench",
            "gemm",
            "--rows",
            "1,8",
            "--save-result",
            str(result_file),
            "--save-dispatch",
            str(dispatch_file),
        ],
    )
    assert run.exit_code == 0, run.output
    assert (
        "skinny GEMM, fused GEMV and fused MMA vs cuBLAS" in run.output and "whole decode chain" in run.output
    )
    saved = json.loads(result_file.read_text())
    for key in ("measured_at", "device", "torch", "triton", "copy_gb_per_s", "timings", "chains"):
        assert key in saved
    assert saved["pdl"] is False  # a CPU tensor never gets PDL
    assert saved["device"] == "fake device" and saved["copy_gb_per_s"] == 1000.0 and saved["complete"]
    # The candidate that failed on shape b is named, at both row counts, and the run went on.
    assert [f["what"] for f in saved["failures"]] == [
        f"[40, 208] M={m} n16·whole·s1·m16·w4·nopdl" for m in (1, 8)
    ]
    assert "failed: [40, 208] M=1" in run.output
    # The fused GEMV (4) beats ours (5) where it was timed, M = 1; the fused MMA (3) at M = 8.
    assert [t["winner"] for t in saved["timings"]] == ["gemv", "mma"] * 2
    assert all(t["ours_us"] == 5.0 and t["cublas_us"] == 10.0 for t in saved["timings"])
    # The fused GEMV at the row counts it takes (M ≤ 4), for both shapes; none at M = 8.
    assert [(t["rows"], t["fused_us"]) for t in saved["timings"]] == [(1, 4.0), (8, None)] * 2
    # The fused MMA above them (M = 8): every candidate timed, the cheapest (the default) kept.
    assert [(t["rows"], t["mma_us"]) for t in saved["timings"]] == [(1, None), (8, 3.0)] * 2
    for n, k in ((48, 64), (40, 208)):
        mma = [
            c for c in saved["candidates"] if c["settings"].startswith("mma·") and (c["n"], c["k"]) == (n, k)
        ]
        assert len(mma) == len(mma_module.mma_candidates(n, k, 16)) > 1 and all(c["rows"] == 8 for c in mma)
        kept = [t["mma_settings"] for t in saved["timings"] if (t["n"], t["k"], t["rows"]) == (n, k, 8)]
        assert kept == [mma_module.mma_settings(n, k, 16).label]
    assert all(c["settings"]["pdl"] for c in saved["chosen"])  # the PDL candidates were cheaper
    chain = saved["chains"]
    assert [c["rows"] for c in chain] == [1, 8] and all(c["gemms"] == 3 for c in chain)
    assert all((c["cublas_us"], c["ours_us"], c["best_us"]) == (30.0, 15.0, 18.0) for c in chain)
    assert all(c["fused_us"] is None for c in chain)  # projections "a", "b": no fused layer op
    # Written after each of the 2 shapes and the 2 chain rows (incomplete), then once complete.
    assert partial_saves == [False] * 4 + [True]
    table = ChoiceTable.load(dispatch_file)
    assert {(c.n, c.k) for c in table.shapes} == {(48, 64), (40, 208)}
    assert all(c.rows == ((1, Backend.GEMV), (8, Backend.MMA)) for c in table.shapes)
    assert all(c.mma == ((8, mma_module.mma_settings(c.n, c.k, 16)),) for c in table.shapes)
    assert saved_dispatch_table(saved) == table  # the saved result reads back to the same table


def test_the_fused_layer_chain_runs_qwen3s_fused_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Qwen3-shaped chain at small sizes (hidden 64, q 32, intermediate 48, vocab 80), two layers.
    layer = [
        Projection("tiny", "qkv", 64, 64, 2),
        Projection("tiny", "o", 64, 32, 2),
        Projection("tiny", "gate-up", 96, 64, 2),
        Projection("tiny", "down", 64, 48, 2),
    ]
    chain = [*layer, *layer, Projection("tiny", "lm-head", 80, 64, 1)]
    weights = [torch.randn(p.n, p.k) / p.k**0.5 for p in chain]
    assert gemm_timing.fused_chain_calls(chain, mma_module.MAX_ROWS + 1, weights) is None
    global_layer = [Projection("tiny", "qk-global", 64, 64, 1), *chain[1:]]
    assert gemm_timing.fused_chain_calls(global_layer, 1, weights) is None
    calls = gemm_timing.fused_chain_calls(chain, 2, weights)
    assert calls is not None and len(calls) == len(chain)
    fusions = [call.args[2] for call in calls if isinstance(call, partial)]
    assert fusions == [gemm_timing.FUSED_LAYER[p.name] for p in chain]
    outputs = [call() for call in calls]  # the real kernels, under the interpreter
    widths = [48 if p.name == "gate-up" else p.n for p in chain]  # gate/up stores SiLU·mul, [M, I]
    assert [tuple(y.shape) for y in outputs if isinstance(y, torch.Tensor)] == [(2, n) for n in widths]
    # Above the GEMV's rows the chain runs the fused MMA, the same fusions.
    mma_calls = gemm_timing.fused_chain_calls(chain, 8, weights)
    assert mma_calls is not None
    assert all(isinstance(c, partial) and c.func is mma_module.fused_mma for c in mma_calls)
    assert [c.args[2] for c in mma_calls if isinstance(c, partial)] == fusions
    outputs = [call() for call in mma_calls]
    assert [tuple(y.shape) for y in outputs if isinstance(y, torch.Tensor)] == [(8, n) for n in widths]
    # The fused chain joins the timed chains at M ≤ 64 (timer replaced as above).
    monkeypatch.setattr(gemm_timing, "graph_us", _fake_graph_us)
    dispatch = gemm_timing.SkinnyDispatch(ChoiceTable(shapes=()))
    timing = gemm_timing.time_decode_chain(
        "tiny", chain, 1, {}, weights, dispatch, torch.float32, 1000.0, failures := []
    )
    assert timing.fused_us == 4.0 * len(chain) and timing.cublas_us == 10.0 * len(chain)
    assert [f.what for f in failures] == ["tiny decode chain M=1 ours"]  # no skinny settings given
