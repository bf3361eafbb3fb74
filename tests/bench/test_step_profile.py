"""The step breakdown of `infer bench latency --breakdown`: kernel categories, busy time, host gap."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.forward_batch import RooflineFacts
from engine.model_runner import PagedModelRunner
from engine.scheduler import BatchScheduler
from infer_cli.bench.latency import Ceilings, PolicyRun, bench_decode, bench_prefill, results_json
from infer_cli.bench.step_profile import (
    OTHER,
    TIMELINE_NAME_CHARS,
    Kernel,
    StepBreakdown,
    category_of,
    profile_steps,
    summarize,
    timeline_shares,
    union_us,
)
from models.registry import ModelOptions, load_model

# Kernel names as CUPTI reports them on an H100/H200 (cuBLAS, FlashInfer, torch, infer's Triton).
NAMED = {
    "nvjet_tst_128x64_64x8_1x1_v_bz_TNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
    "_invariant_gemm_kernel": "gemm",
    "void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u>": "attention",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<>>": "attention",
    "attention_prep_kernel": "prep",
    "_decode_attention_split_kernel": "attention",
    "_decode_attention_merge_kernel": "attention",
    "_invariant_rmsnorm_kernel": "norm",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float>": "sampling",
    "_token_draw_kernel": "sampling",
    "_token_draw_finish_kernel": "sampling",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
    "void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda>": "copy",
    "Memcpy DtoH (Device -> Pinned)": "copy",
    "some_new_kernel": OTHER,
}


@pytest.mark.parametrize(("name", "category"), NAMED.items())
def test_kernel_names_fall_in_their_category(name: str, category: str) -> None:
    assert category_of(name) == category


def test_busy_time_counts_overlapping_kernels_once() -> None:
    kernels = [Kernel("a", 0, 10), Kernel("b", 5, 10), Kernel("c", 30, 5), Kernel("d", 31, 1)]
    assert union_us(kernels) == 20.0  # [0, 15) and [30, 35)


def test_summary_averages_over_the_steps_and_keeps_the_heaviest_names() -> None:
    kernels = [Kernel("nvjet_gemm", 0, 800), Kernel("nvjet_gemm", 2000, 800), Kernel("mystery", 900, 400)]
    b = summarize(kernels, busy_us=2000, steps=2, host_ms=1.5)
    assert b.category_ms("gemm") == pytest.approx(0.8)
    assert b.category_ms(OTHER) == pytest.approx(0.2)
    assert b.busy_ms == pytest.approx(1.0) and b.host_gap_ms == pytest.approx(0.5)
    assert b.kernels_per_step == 1.5
    assert b.top[0] == ("nvjet_gemm", pytest.approx(0.8))


def test_host_calls_into_cuda_are_summed_by_name_heaviest_first() -> None:
    calls = [
        Kernel("cudaLaunchKernel", 0, 4),
        Kernel("cudaMemcpyAsync", 10, 9000),  # a copy that waited for the device
        Kernel("cudaLaunchKernel", 20, 6),
        Kernel("cuLaunchKernelEx", 30, 8),
    ]
    b = summarize([Kernel("nvjet_gemm", 0, 800)], busy_us=800, steps=2, host_ms=6.0, host_calls=calls)
    assert b.host_calls[0] == ("cudaMemcpyAsync", 0.5, pytest.approx(4.5))
    assert b.host_calls[1:] == (
        ("cudaLaunchKernel", 1.0, pytest.approx(0.005)),
        ("cuLaunchKernelEx", 0.5, pytest.approx(0.004)),
    )
    saved = json.loads(json.dumps(asdict(b)))
    assert StepBreakdown.from_saved(saved) == b
    # A report written before host calls were counted still loads, with none.
    del saved["host_calls"]
    assert StepBreakdown.from_saved(saved).host_calls == ()


def test_profiling_a_cpu_step_finds_its_matmul_and_softmax() -> None:
    a, w = torch.randn(64, 256), torch.randn(256, 256)

    def step() -> None:
        torch.softmax(a @ w, dim=-1)

    b = profile_steps(step, torch.device("cpu"), host_ms=1.0, steps=2)
    assert b.category_ms("gemm") > 0 and b.category_ms("sampling") > 0
    # One thread: busy is the operators' own time, which the categories split without remainder.
    assert sum(ms for _, ms in b.by_category) == pytest.approx(b.busy_ms)
    assert b.host_calls == ()  # no CUDA on the CPU


def _tiny_scheduler(checkpoint: Path) -> tuple[BatchScheduler, RooflineFacts]:
    engine = EngineConfig(
        max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False, num_kv_pages=64
    )
    scheduler = load_model(str(checkpoint), ModelOptions(engine=engine, device="cpu")).scheduler
    assert isinstance(scheduler, BatchScheduler) and isinstance(scheduler.runner, PagedModelRunner)
    return scheduler, scheduler.runner.model.roofline()


def test_bench_loops_attach_a_breakdown_and_the_json_carries_it(tiny_qwen3: Path) -> None:
    scheduler, facts = _tiny_scheduler(tiny_qwen3)
    ceilings = Ceilings(copy_gb_per_s=4000.0, matmul_tflops=800.0, stream_gb_per_s=4200.0)
    decode = bench_decode(scheduler, facts, ceilings, batch=2, context=20, iters=2, breakdown=True)
    prefill = bench_prefill(scheduler, facts, ceilings, tokens=32, iters=1, breakdown=True)
    for b in (decode.breakdown, prefill.breakdown):
        assert b is not None and b.category_ms("gemm") > 0 and b.kernels_per_step > 0
    load = scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)
    payload = json.loads(
        json.dumps(results_json([PolicyRun("tuned", (decode,), (prefill,))], ceilings, facts))
    )
    row = payload["decode"][0]["breakdown"]
    assert row["host_gap_ms"] >= 0 and dict(row["by_category"])["gemm"] > 0


def test_a_profiler_that_fails_leaves_the_timings(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr("infer_cli.bench.latency.profile_steps", broken)
    scheduler, facts = _tiny_scheduler(tiny_qwen3)
    ceilings = Ceilings(copy_gb_per_s=4000.0, matmul_tflops=800.0, stream_gb_per_s=4200.0)
    decode = bench_decode(scheduler, facts, ceilings, batch=2, context=20, iters=2, breakdown=True)
    assert decode.breakdown is None and decode.step_ms > 0
    assert "CUPTI_ERROR_NOT_INITIALIZED" in caplog.text


def test_the_timeline_is_the_last_steps_kernels_timed_from_its_first() -> None:
    kernels = [
        Kernel("norm", 0, 5),
        Kernel("gemv", 4, 10),
        Kernel("gemv", 130, 10),  # listed out of order: the timeline sorts by start
        Kernel("norm", 100, 5),
        Kernel("x" * 200, 150, 1),
    ]
    b = summarize(kernels, busy_us=30, steps=2, host_ms=0.1)
    # 5 kernels over 2 steps: the last step is the last round(2.5) = 2 by start (130 and 150).
    assert [name for name, _, _ in b.timeline] == ["gemv", "x" * TIMELINE_NAME_CHARS]
    assert [start for _, start, _ in b.timeline] == [0.0, 20.0]
    saved = json.loads(json.dumps(asdict(b)))
    assert StepBreakdown.from_saved(saved) == b
    even = summarize(
        [Kernel("a", 0, 1), Kernel("b", 3, 1), Kernel("a", 10, 1), Kernel("b", 14, 2)], 5, 2, 0.1
    )
    assert even.timeline == (("a", 0.0, 1.0), ("b", 4.0, 2.0))


def test_timeline_shares_split_the_busy_time_once_and_name_the_gaps() -> None:
    timeline = [
        ("norm", 0.0, 2.0),
        ("gemv", 1.0, 10.0),  # starts under the norm (PDL): advances 9, not 10
        ("flashinfer::Decode<128, true>", 12.0, 5.0),  # 1 µs idle before it
        ("gemv", 16.0, 0.5),  # ends inside the attention: advances nothing
        ("merge", 17.0, 1.0),
    ]
    shares = {s.name: s for s in timeline_shares(timeline)}
    assert set(shares) == {"norm", "gemv", "flashinfer::Decode", "merge"}
    assert shares["gemv"].count == 2 and shares["gemv"].duration_us == 10.5
    assert shares["gemv"].advance_us == 9.0 and shares["flashinfer::Decode"].idle_before_us == 1.0
    busy = union_us(Kernel(n, start, us) for n, start, us in timeline)
    assert sum(s.advance_us for s in shares.values()) == pytest.approx(busy)
    assert timeline_shares([])[:1] == []
