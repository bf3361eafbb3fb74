"""GEMM numeric policies: selection by name, `per-token` and `pin` semantics, the graph-memory budget
arithmetic (which buckets fit, reserved against measured) and `infer bench --buckets` without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from engine.config import EngineConfig
from engine.contract import ContractError
from engine.cuda_graphs import CaptureRecord, TrialCapture
from engine.graph_budget import (
    BucketMemory,
    ReserveCheck,
    fit_buckets,
    graph_bytes_up_to,
    graphs_available,
    require_fit,
)
from engine.memory_budget import GIB, MemoryBudgetError
from infer_cli.engine_options import Knobs
from infer_cli.main import app
from kernels.gemm import NumericPolicy, UnknownPolicyError, parse_policies, parse_policy
from kernels.gemm.cpu_gemv import CpuLinear
from kernels.gemm.dispatch import invariant_linear, policy_linear
from kernels.gemm.per_token import per_token_linear
from kernels.gemm.pin import PinError, PinnedGemm, WeightShape
from kernels.gemm.skinny_dispatch import MEASURED_TABLES, SkinnyDispatch, measured_table
from kernels.triton.invariant_gemm import GemmTiles

MIB = 1 << 20


def _operands(rows: int = 9, k: int = 32, n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5


# --- selection by name -------------------------------------------------------------------------


def test_policy_names_parse_and_unknown_is_refused_by_name() -> None:
    assert [parse_policy(n) for n in ("tuned", "pin", "per-token", "invariant")] == list(NumericPolicy)
    with pytest.raises(UnknownPolicyError, match=r"'per_token'.*tuned, pin, per-token, invariant"):
        parse_policy("per_token")
    assert parse_policies("tuned, invariant") == (NumericPolicy.TUNED, NumericPolicy.INVARIANT)
    with pytest.raises(UnknownPolicyError, match="twice"):
        parse_policies("pin,pin")
    with pytest.raises(UnknownPolicyError, match="'bogus'"):
        parse_policies("tuned,bogus")


def test_engine_config_validates_the_policy_name() -> None:
    assert EngineConfig().numeric_policy == "tuned"
    assert EngineConfig(numeric_policy="invariant").numeric_policy == "invariant"
    with pytest.raises(ContractError, match="numeric_policy='fast'"):
        EngineConfig(numeric_policy="fast")


def test_serve_flag_reaches_the_engine_config_and_refuses_unknown_names() -> None:
    config = Knobs({"numeric_policy": "per-token"}).engine_config()
    assert config.numeric_policy == "per-token"
    result = CliRunner().invoke(app, ["serve", "--model", "sim", "--numeric-policy", "fastest"])
    assert result.exit_code == 2
    assert "numeric_policy='fastest'" in result.output


def test_policy_linear_by_name() -> None:
    assert policy_linear("tuned") is F.linear
    assert policy_linear("per-token") is per_token_linear
    assert policy_linear(NumericPolicy.INVARIANT) is invariant_linear
    pinned = policy_linear("pin")
    assert isinstance(pinned, PinnedGemm) and pinned is not policy_linear("pin")
    with pytest.raises(UnknownPolicyError, match="'cublas'"):
        policy_linear("cublas")


def test_tuned_follows_the_table_measured_on_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(policy_linear("tuned", torch.device("cpu")), CpuLinear)
    cuda = torch.device("cuda", 0)
    # Each shipped table covers every decode projection of Qwen3-4B and Gemma 4 12B in bf16.
    for device_name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=device_name: name)
        dispatch = policy_linear("tuned", cuda)
        assert isinstance(dispatch, SkinnyDispatch) and dispatch.table.device == device_name
        for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151936, 2560), (262144, 3840)):
            assert dispatch.table.lookup(n, k, torch.bfloat16) is not None, (device_name, n, k)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Other GPU")
    assert policy_linear("tuned", cuda) is F.linear


def test_every_shipped_table_loads_and_names_its_device() -> None:
    for device in MEASURED_TABLES:
        table = measured_table(device)
        assert table is not None and table.device == device, device


def test_skinny_dispatch_past_its_rows_is_cublas_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    table = measured_table("NVIDIA H200")
    assert table is not None
    dispatch = SkinnyDispatch(table)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(65, 4096, generator=g).bfloat16()
    w = (torch.randn(2560, 4096, generator=g) / 64).bfloat16()
    with caplog.at_level("INFO", logger="infer.gemm"):
        assert torch.equal(dispatch(x, w), F.linear(x, w))
        dispatch(x, w)
    said = [r for r in caplog.records if "M=65 is beyond the largest measured M=64" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO"


# --- per-token ---------------------------------------------------------------------------------


def test_per_token_is_row_by_row_and_bit_identical_alone_and_batched() -> None:
    x, w = _operands()
    batched = per_token_linear(x, w)
    for i in range(len(x)):
        assert torch.equal(per_token_linear(x[i : i + 1], w)[0], batched[i]), f"row {i}"
        assert torch.equal(F.linear(x[i : i + 1], w)[0], batched[i]), f"row {i}"
    torch.testing.assert_close(batched, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert per_token_linear(x[:4].reshape(2, 2, 32), w).shape == (2, 2, 48)


# --- pin ---------------------------------------------------------------------------------------


def test_pin_chooses_once_per_weight_shape_and_reuses_it_for_every_row_count() -> None:
    x, w = _operands(k=32)
    pin = PinnedGemm()
    full = pin(x, w)
    for m in (1, 2, 5):
        assert torch.equal(pin(x[:m], w), full[:m]), f"{m} rows"
    shape = WeightShape(48, 32, torch.float32)
    assert list(pin.pinned) == [shape]
    assert pin.pinned[shape].block_k == 32  # the first candidate whose unmasked K loop runs K=32
    torch.testing.assert_close(full, F.linear(x, w), rtol=1e-5, atol=1e-5)
    pin(x[:, :16], w[:, :16])
    assert len(pin.pinned) == 2


def test_pin_refuses_loudly_naming_the_shape() -> None:
    x, w = _operands(k=40)
    with pytest.raises(PinError, match=r"weight shape \[48, 40\] float32: no pinnable configuration"):
        PinnedGemm()(x, w)
    pin = PinnedGemm()
    shape = WeightShape(48, 40, torch.float32)
    with pytest.raises(
        PinError, match=r"\[48, 40\] float32: cannot pin .*K=40 is not a multiple of block_k=16"
    ):
        pin.pin(shape, GemmTiles(block_m=16, block_n=16, block_k=16, even_k=True))
    pin.pin(shape, GemmTiles(block_m=16, block_n=16, block_k=16))
    with pytest.raises(PinError, match=r"\[48, 40\] float32 is already pinned"):
        pin.pin(shape, GemmTiles(block_m=16, block_n=16, block_k=32))
    torch.testing.assert_close(pin(x[:3], w), F.linear(x[:3], w), rtol=1e-5, atol=1e-5)


# --- graph-memory budget -----------------------------------------------------------------------


def _linear_growth(per_bucket_mib: int) -> list[BucketMemory]:
    """A pool of 100 MiB taken by the largest bucket, plus per-graph memory growing with the bucket."""
    buckets = (1, 2, 4, 8, 16, 32)
    return [
        BucketMemory(b, (b * per_bucket_mib + (100 if b == 32 else 0)) * MIB, (100 if b == 32 else 0) * MIB)
        for b in buckets
    ]


def test_graph_bytes_counts_the_whole_pool_plus_each_graph_up_to_the_top() -> None:
    records = _linear_growth(2)
    assert graph_bytes_up_to(records, 4) == (100 + 2 + 4 + 8) * MIB
    assert graph_bytes_up_to(records, 32) == (100 + 2 * 63) * MIB
    with pytest.raises(ValueError, match="measured once"):
        graph_bytes_up_to([*records, records[0]], 4)


def test_fit_names_the_buckets_that_fit_and_start_up_refuses_with_the_largest() -> None:
    records = _linear_growth(2)
    assert fit_buckets(records, 1 * GIB).all_fit
    fit = fit_buckets(records, (100 + 2 + 4 + 8 + 16) * MIB)
    assert fit.fitting == (1, 2, 4, 8) and fit.refused == (16, 32) and fit.largest == 8
    with pytest.raises(
        MemoryBudgetError,
        match=r"bucket 32 under numeric policy 'per-token'.*largest bucket that fits is 8: pass --max-num-seqs 8",
    ):
        require_fit(records, (100 + 30) * MIB, "per-token")
    with pytest.raises(MemoryBudgetError, match="not even bucket 1 fits"):
        require_fit(records, 50 * MIB, "per-token")
    assert require_fit(records, 1 * GIB, "tuned").largest == 32


def test_graphs_available_and_reserved_against_measured() -> None:
    assert graphs_available(100 * GIB, 0.9, 40 * GIB, 5 * GIB, 1 * GIB) == 44 * GIB
    assert ReserveCheck(226 * MIB, 226 * MIB).diff_pct == 0.0
    over = ReserveCheck(289 * MIB, 226 * MIB)
    assert over.diff_pct == pytest.approx(100 * 63 / 226)
    assert not over.within(10.0) and ReserveCheck(240 * MIB, 226 * MIB).within(10.0)
    assert ReserveCheck(0, 0).diff_pct == 0.0


def _record(bucket: int, added_mib: int, pool_mib: int) -> CaptureRecord:
    return CaptureRecord(bucket, 10 * GIB, 10 * GIB - added_mib * MIB, 0, pool_mib * MIB, 0.1)


def test_the_reserve_leaves_out_what_the_trial_left_resident() -> None:
    """Seen on the H200: every trial bucket took ~10 MiB outside the pool that the real capture did
    not take again (kernel modules first loaded under capture stay loaded). That memory is read as
    resident at sizing time, so the graph reserve must not count it a second time."""
    records = (_record(256, 828, 752), _record(160, 170, 160), _record(128, 18, 8))
    trial = TrialCapture(records, persisted_outside=96 * MIB)
    assert trial.captured_bytes == 1016 * MIB
    assert trial.reserve_bytes == 920 * MIB
    assert ReserveCheck(trial.reserve_bytes, (720 + 160 + 8) * MIB).within(10.0)
    assert not ReserveCheck(trial.captured_bytes, (720 + 160 + 8) * MIB).within(10.0)
    assert TrialCapture(records, persisted_outside=2 * GIB).reserve_bytes == 0


# --- infer bench --buckets ---------------------------------------------------------------------


def test_bench_buckets_parsing_and_the_no_cuda_error() -> None:
    from infer_cli.bench.buckets_cmd import parse_buckets

    assert parse_buckets("8,1,2,8") == (1, 2, 8)
    assert parse_buckets("all")[0] == 1 and parse_buckets("all")[-1] == 256
    result = CliRunner().invoke(app, ["bench", "--buckets", "1,300", "--model", "x"])
    assert result.exit_code == 2 and "1..256" in result.output
    if not torch.cuda.is_available():
        result = CliRunner().invoke(app, ["bench", "--buckets", "1,2", "--model", "x"])
        assert result.exit_code == 2 and "needs a CUDA GPU" in result.output


def test_bench_buckets_report_writes_json_and_plot(tmp_path: Path) -> None:
    from rich.console import Console

    from infer_cli.bench.buckets_cmd import _report

    def sweep(policy: str, per_row: int) -> dict[str, object]:
        rows = [
            {
                "policy": policy,
                "bucket": b,
                "device_bytes": b * per_row * MIB,
                "pool_bytes": 0,
                "nodes": 3 * b,
                "replay_ms": 0.1,
                "capture_s": 0.2,
            }
            for b in (1, 2, 4)
        ]
        return {
            "policy": policy,
            "buckets": rows,
            "reserved_bytes": 7 * per_row * MIB,
            "measured_bytes": 7 * per_row * MIB,
            "reserved_vs_measured_pct": 0.0,
            "graphs_available_bytes": GIB,
            "buckets_that_fit": [1, 2, 4],
            "largest_bucket_that_fits": 4,
        }

    result = {
        "model": "m",
        "device": "d",
        "gpu_memory_utilization": 0.9,
        "policies": [sweep("tuned", 1), sweep("per-token", 5)],
    }
    console = Console(record=True, width=200)
    out = tmp_path / "buckets.json"
    _report(result, console, out, plot=True)
    assert json.loads(out.read_text())["policies"][1]["policy"] == "per-token"
    assert (tmp_path / "buckets.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = console.export_text()
    assert "per-token" in text and "largest bucket that fits" in text


def test_qwen3_line_applies_the_configured_policy(tiny_qwen3: Path) -> None:
    from engine.model_runner import PagedModelRunner
    from engine.scheduler import BatchScheduler
    from models.registry import ModelOptions, load_model

    engine = EngineConfig(numeric_policy="per-token", num_kv_pages=8)
    scheduler = load_model(str(tiny_qwen3), ModelOptions(engine=engine, device="cpu")).scheduler
    assert isinstance(scheduler, BatchScheduler) and isinstance(scheduler.runner, PagedModelRunner)
    assert getattr(scheduler.runner.model, "linear", None) is per_token_linear
