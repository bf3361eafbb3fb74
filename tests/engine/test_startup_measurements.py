"""Start-up's device measurements, run on the CPU against a stand-in for torch.cuda's memory counters:
what `measure_activations` reserves, and what `trial_capture` says stayed resident. The arithmetic
they feed is in test_numeric_policy.py and test_memory_budget.py; these check the glue that only a
GPU start-up would otherwise reach."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine import cuda_graphs, paged_startup
from engine.config import EngineConfig
from engine.cuda_graphs import CaptureRecord, trial_capture
from engine.graph_budget import capture_out_of_memory
from engine.memory_budget import MemoryBudgetError
from engine.model_runner import PagedModelRunner
from engine.scheduler import BatchScheduler
from models.registry import ModelOptions, load_model

MIB = 1 << 20


@dataclass
class FakeAllocator:
    """torch.cuda's allocator counters, moved by hand."""

    allocated: int = 100 * MIB
    reserved: int = 200 * MIB
    peak: int = 100 * MIB
    calls: list[str] = field(default_factory=list)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def reset_peak(*_: object) -> None:
            self.peak = self.allocated
            self.calls.append("reset_peak")

        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.calls.append("empty_cache"))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *_: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *_: self.reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *_: self.peak)


def _tiny_model(checkpoint: Path, max_num_seqs: int, budget: int) -> tuple[object, object, EngineConfig]:
    engine = EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_prefix_caching=False, num_kv_pages=64
    )
    scheduler = load_model(str(checkpoint), ModelOptions(engine=engine, device="cpu")).scheduler
    assert isinstance(scheduler, BatchScheduler) and isinstance(scheduler.runner, PagedModelRunner)
    return scheduler.runner.model, scheduler.runner.attention, engine


@pytest.mark.parametrize(
    ("peak_mib", "held_mib", "want_mib"),
    [(300, 120, 300), (300, 420, 420)],
    ids=["the allocated peak", "the cache behind it"],
)
def test_activations_are_the_peak_or_what_the_cache_holds_after_both_shapes(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch, peak_mib: int, held_mib: int, want_mib: int
) -> None:
    model, attention, engine = _tiny_model(tiny_qwen3, max_num_seqs=4, budget=48)
    fake = FakeAllocator()
    fake.install(monkeypatch)
    steps: list[int | None] = []
    real_step = paged_startup.profile_step

    def recording_step(m: object, a: object, config: EngineConfig, tokens: int | None = None) -> None:
        real_step(m, a, config, tokens)  # type: ignore[arg-type]
        steps.append(tokens)
        if tokens is None:  # the prefill comes last: leave the counters as serving would
            fake.peak = fake.allocated + peak_mib * MIB
            fake.reserved += held_mib * MIB

    monkeypatch.setattr(paged_startup, "profile_step", recording_step)
    got = paged_startup.measure_activations(model, attention, engine)  # type: ignore[arg-type]
    assert steps == [4, None], "a decode-shaped step (max_num_seqs rows), then the token-budget prefill"
    assert fake.calls[:2] == ["empty_cache", "reset_peak"], "the cache is emptied before counting"
    assert got == want_mib * MIB


class _Graphs:
    def __init__(self) -> None:
        self.buckets = (128, 160, 256)
        self.records: list[CaptureRecord] = []


def test_trial_capture_reports_what_stayed_and_keeps_no_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    outside = iter([700 * MIB, 796 * MIB])  # before the trial, after it was dropped
    monkeypatch.setattr(cuda_graphs, "outside_torch_bytes", lambda: next(outside))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    alive: list[weakref.ref[_Graphs]] = []

    def capture(graphs: cuda_graphs.GraphedDecode) -> None:
        alive.append(weakref.ref(graphs))  # type: ignore[arg-type]
        graphs.records.extend(
            CaptureRecord(b, 10_000 * MIB, (10_000 - added) * MIB, 0, pool * MIB, 0.1)
            for b, added, pool in ((256, 828, 752), (160, 170, 160), (128, 18, 8))
        )

    trial = trial_capture(_Graphs(), capture, "tuned")  # type: ignore[arg-type]
    gc.collect()
    assert alive[0]() is None, "the trial's graphs must be gone when the pool is sized"
    assert [r.bucket for r in trial.records] == [256, 160, 128]
    assert trial.persisted_outside == 96 * MIB
    assert trial.captured_bytes == 1016 * MIB and trial.reserve_bytes == 920 * MIB


def test_memory_that_left_with_the_trial_is_not_taken_off(monkeypatch: pytest.MonkeyPatch) -> None:
    outside = iter([700 * MIB, 650 * MIB])
    monkeypatch.setattr(cuda_graphs, "outside_torch_bytes", lambda: next(outside))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def capture(graphs: cuda_graphs.GraphedDecode) -> None:
        graphs.records.append(CaptureRecord(8, 1000 * MIB, 900 * MIB, 0, 60 * MIB, 0.1))

    trial = trial_capture(_Graphs(), capture, "tuned")  # type: ignore[arg-type]
    assert trial.persisted_outside == 0 and trial.reserve_bytes == 100 * MIB


def test_a_trial_out_of_memory_is_refused_naming_the_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graphs, "outside_torch_bytes", lambda: 700 * MIB)

    def capture(graphs: cuda_graphs.GraphedDecode) -> None:
        graphs.records.append(CaptureRecord(256, 10_000 * MIB, 9_000 * MIB, 0, 900 * MIB, 0.1))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(MemoryBudgetError) as refused:
        trial_capture(_Graphs(), capture, "per-token")  # type: ignore[arg-type]
    message = str(refused.value)
    assert "'per-token'" in message and "at bucket 160 after buckets 256" in message, message
    assert "--max-num-seqs" in message and "--enforce-eager" in message
    assert isinstance(refused.value.__cause__, torch.cuda.OutOfMemoryError)


def test_an_out_of_memory_at_the_first_bucket_names_it_alone() -> None:
    message = str(capture_out_of_memory(256, [], "tuned"))
    assert "at bucket 256, before the KV pool" in message and "after buckets" not in message
