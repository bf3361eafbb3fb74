"""The latency benchmark's arithmetic and its drive loop, on a tiny CPU model (no timing asserted)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.forward_batch import RooflineFacts
from engine.model_runner import PagedModelRunner
from engine.scheduler import BatchScheduler
from infer_cli.bench.latency import Ceilings, bench_decode, bench_prefill, decode_floor_ms, prefill_floor_ms
from models.registry import LoadedModel, ModelOptions, load_model

FACTS = RooflineFacts(
    weight_bytes=8_000_000_000,
    matmul_params=4_000_000_000,
    kv_bytes_per_token=1000,
    attention_flops_per_pair=10,
)
CEILINGS = Ceilings(copy_gb_per_s=4000.0, matmul_tflops=800.0, stream_gb_per_s=4200.0)


def test_decode_floor_counts_weights_and_the_batch_kv() -> None:
    # 8 GB of weights + 64 rows × 512 tokens × 1000 B of KV, at 4000 GB/s copied, 4200 GB/s streamed.
    moved = 8e9 + 64 * 512 * 1000
    assert decode_floor_ms(FACTS, 64, 512, CEILINGS) == pytest.approx(moved / 4000e9 * 1e3)
    assert decode_floor_ms(FACTS, 64, 512, CEILINGS, stream=True) == pytest.approx(moved / 4200e9 * 1e3)


def test_decode_floor_counts_each_row_s_recurrent_state_read_and_written() -> None:
    with_state = replace(FACTS, state_bytes_per_row=50_000_000)
    moved = 8e9 + 64 * 512 * 1000 + 64 * 2 * 50e6
    assert decode_floor_ms(with_state, 64, 512, CEILINGS) == pytest.approx(moved / 4000e9 * 1e3)


def test_prefill_floor_counts_projections_and_causal_attention() -> None:
    tokens = 1024
    flops = 2 * 4e9 * tokens + 10 * tokens * (tokens + 1) / 2
    assert prefill_floor_ms(FACTS, tokens, CEILINGS) == pytest.approx(flops / 800e12 * 1e3)


@pytest.mark.parametrize(("async_scheduling", "temperature"), [(False, 0.0), (True, 0.0), (False, 1.0)])
def test_bench_loops_run_and_leave_the_engine_idle(
    tiny_qwen3: Path, async_scheduling: bool, temperature: float
) -> None:
    engine = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        num_kv_pages=64,
        async_scheduling=async_scheduling,
    )
    loaded = load_model(str(tiny_qwen3), ModelOptions(engine=engine, device="cpu"))
    scheduler = loaded.scheduler
    assert isinstance(scheduler, BatchScheduler) and isinstance(scheduler.runner, PagedModelRunner)
    facts = scheduler.runner.model.roofline()
    decode = bench_decode(scheduler, facts, CEILINGS, batch=4, context=20, iters=3, temperature=temperature)
    prefill = bench_prefill(scheduler, facts, CEILINGS, tokens=48, iters=2)
    assert decode.batch == 4 and decode.step_ms > 0 and decode.replay_ms is None
    assert prefill.tokens == 48 and prefill.ms > 0
    assert prefill.min_ms is not None and prefill.max_ms is not None
    assert 0 < prefill.min_ms <= prefill.ms <= prefill.max_ms
    # The allocator is CUDA's: on the CPU there is nothing to count.
    assert decode.allocator is None and prefill.allocator is None
    load = scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)
    assert (scheduler.async_stats.launches > 0) == async_scheduling


def test_decode_rows_outlive_a_long_chunked_prefill(tiny_qwen3: Path) -> None:
    """Under a token budget far below the batch's prompts, the first requests decode for many steps
    while the last still prefill: every row must still be there for each timed step."""
    engine = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=12, enable_prefix_caching=False, num_kv_pages=64
    )
    loaded = load_model(str(tiny_qwen3), ModelOptions(engine=engine, device="cpu"))
    scheduler = loaded.scheduler
    assert isinstance(scheduler, BatchScheduler) and isinstance(scheduler.runner, PagedModelRunner)
    decode = bench_decode(
        scheduler, scheduler.runner.model.roofline(), CEILINGS, batch=8, context=40, iters=3
    )
    assert decode.batch == 8 and decode.step_ms > 0
    load = scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0)


def test_results_json_tags_every_row_with_its_policy() -> None:
    from infer_cli.bench.latency import DecodeResult, PolicyRun, PrefillResult, results_json

    runs = [
        PolicyRun(
            policy,
            tuple(DecodeResult(b, 512, 2.0, 1.5, 1.0, 0.9) for b in (1, 8)),
            (PrefillResult(8192, 50.0, 40.0),),
        )
        for policy in ("tuned", "invariant")
    ]
    payload = results_json(runs, CEILINGS, FACTS)
    assert payload["numeric_policies"] == ["tuned", "invariant"]
    decode = payload["decode"]
    prefill = payload["prefill"]
    assert isinstance(decode, list) and isinstance(prefill, list)
    assert [(row["policy"], row["batch"]) for row in decode] == [
        ("tuned", 1),
        ("tuned", 8),
        ("invariant", 1),
        ("invariant", 8),
    ]
    assert [(row["policy"], row["tokens"]) for row in prefill] == [("tuned", 8192), ("invariant", 8192)]
    assert decode[0]["pct_of_floor"] == pytest.approx(50.0)
    assert decode[0]["pct_of_stream_floor"] == pytest.approx(45.0)


def test_latency_cli_refuses_an_unknown_policy_by_name_before_anything_loads(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from infer_cli.main import app

    result = CliRunner().invoke(
        app, ["bench", "latency", "--model", str(tmp_path), "--numeric-policy", "tuned,fastest"]
    )
    assert result.exit_code == 2
    assert "fastest" in result.output
    duplicate = CliRunner().invoke(
        app, ["bench", "latency", "--model", str(tmp_path), "--numeric-policy", "invariant,invariant"]
    )
    assert duplicate.exit_code == 2 and "twice" in duplicate.output


def test_latency_cli_hands_its_backends_and_decode_fusion_to_the_model_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--gdn-backend`, `--attention-backend` and `--decode-fusion` reach the ModelOptions the checkpoint is loaded with (the load itself is
    replaced: this machine has no GPU), and an unknown one is refused by name before anything."""
    import torch
    from typer.testing import CliRunner

    import infer_cli.bench.latency
    import models.registry
    from infer_cli.main import app

    unknown = CliRunner().invoke(app, ["bench", "latency", "--model", str(tmp_path), "--gdn-backend", "cuda"])
    assert unknown.exit_code == 2 and "--gdn-backend" in unknown.output and "fla" in unknown.output

    seen: list[ModelOptions] = []

    class Loaded(Exception):
        pass

    def spy(spec: str, options: ModelOptions) -> None:
        seen.append(options)
        raise Loaded

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(infer_cli.bench.latency, "measure_ceilings", lambda device: CEILINGS)
    monkeypatch.setattr(models.registry, "load_model", spy)
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "latency",
            "--model",
            str(tmp_path),
            "--gdn-backend",
            "fla",
            "--attention-backend",
            "triton",
            "--decode-fusion",
            "--batch-sizes",
            "1,8",
        ],
    )
    assert isinstance(result.exception, Loaded), result.output
    (options,) = seen
    assert (options.gdn_backend, options.device, options.engine.max_num_seqs) == ("fla", "cuda", 8)
    assert options.attention_backend == "triton"
    assert options.decode_fusion
    assert not options.engine.enable_prefix_caching


def test_latency_cli_runs_sharded_at_the_tensor_parallel_size_and_records_it(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--tensor-parallel-size 2` reaches the engine: the benchmark runs on the tiny checkpoint split
    over two gloo ranks (the load is moved to the CPU and the device calls stood in for: this
    machine has no GPU) and the saved result records the size."""
    import json

    import torch
    from typer.testing import CliRunner

    import infer_cli.bench.latency
    import models.registry
    from engine.parallel.runner import TensorParallelRunner
    from infer_cli.main import app

    real_load = models.registry.load_model
    runners: list[object] = []

    def on_cpu(spec: str, options: ModelOptions) -> LoadedModel:
        loaded = real_load(spec, replace(options, device="cpu"))
        runners.append(loaded.scheduler.runner)  # type: ignore[attr-defined]
        return loaded

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "no GPU (test)")
    monkeypatch.setattr(infer_cli.bench.latency, "measure_ceilings", lambda device: CEILINGS)
    monkeypatch.setattr(models.registry, "load_model", on_cpu)
    saved = tmp_path / "latency.json"
    args = ["bench", "latency", "--model", str(tiny_qwen3), "--batch-sizes", "1,2", "--context", "16"]
    args += ["--prefill-lens", "16", "--save-result", str(saved)]
    result = CliRunner().invoke(app, [*args, "--tensor-parallel-size", "2"])
    assert result.exit_code == 0, result.output
    (runner,) = runners
    assert isinstance(runner, TensorParallelRunner) and len(runner.worker_pids()) == 1
    report = json.loads(saved.read_text())
    assert report["tensor_parallel_size"] == 2
    assert [row["batch"] for row in report["decode"]] == [1, 2]


def test_latency_cli_refuses_a_split_by_name_before_anything_loads(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from typer.testing import CliRunner

    import infer_cli.bench.latency
    import models.registry
    from infer_cli.main import app

    def never(*args: object) -> None:
        raise AssertionError("measured or loaded before the split was checked")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(infer_cli.bench.latency, "measure_ceilings", never)
    monkeypatch.setattr(models.registry, "load_model", never)
    base = ["bench", "latency", "--model", str(tiny_qwen3), "--tensor-parallel-size"]
    result = CliRunner().invoke(app, [*base, "3"], env={"COLUMNS": "200"})
    flat = " ".join(result.output.split())
    assert result.exit_code == 2 and "field 'num_attention_heads' = 4" in flat, result.output
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = CliRunner().invoke(app, [*base, "2"], env={"COLUMNS": "200"})
    flat = " ".join(result.output.split())
    assert result.exit_code == 2 and "each rank needs a GPU of its own and 1 is visible" in flat, (
        result.output
    )


def test_bucket_sweep_refuses_tensor_parallelism_by_name(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from infer_cli.main import app

    result = CliRunner().invoke(
        app,
        ["bench", "--buckets", "1,2", "--model", str(tmp_path), "--tensor-parallel-size", "2"],
        env={"COLUMNS": "200"},
    )
    flat = " ".join(result.output.split())
    assert (
        result.exit_code == 2
        and "--tensor-parallel-size" in flat
        and "sweep over sharded ranks is not built" in flat
    ), result.output
