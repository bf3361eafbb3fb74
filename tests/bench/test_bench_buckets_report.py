"""`infer bench --buckets`' report on the CPU: the first-capture figure each bucket carries, the
table, the plot, and a policy refused by name (the measuring itself needs a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from rich.console import Console

from engine.graph_budget import GraphFit, ReserveCheck, capture_out_of_memory
from infer_cli.bench.bucket_sweep import BucketMeasurement, PolicySweep, sweep_json
from infer_cli.bench.buckets_cmd import MIB, bucket_table, plot_sweeps, run_bucket_bench


def _sweep(policy: str, node_mib_per_row: int) -> PolicySweep:
    rows = tuple(
        BucketMeasurement(
            policy=policy,
            bucket=b,
            device_bytes=2 * b * MIB,
            pool_bytes=2 * b * MIB,
            nodes=366 if node_mib_per_row == 0 else 220 * b,
            replay_ms=1.0,
            capture_s=0.1,
            first_device_bytes=(2 + node_mib_per_row) * b * MIB,
            first_pool_bytes=2 * b * MIB,
        )
        for b in (1, 8, 64)
    )
    measured = sum(m.device_bytes for m in rows)
    fit = GraphFit(fitting=(1, 8, 64), refused=(), available=10 << 30, needed=measured)
    return PolicySweep(policy, rows, ReserveCheck(measured, measured), fit, node_mib_per_row * MIB)


def test_first_capture_outside_the_pool_is_reported_per_bucket(tmp_path: Path) -> None:
    result = sweep_json([_sweep("invariant", 0), _sweep("per-token", 3)], {"model": "m", "device": "d"})
    per_token = result["policies"][1]
    assert [m["first_outside_pool_bytes"] // MIB for m in per_token["buckets"]] == [3, 24, 192]
    assert [m["first_outside_pool_bytes"] for m in result["policies"][0]["buckets"]] == [0, 0, 0]
    assert per_token["first_capture_persisted_outside_bytes"] == 3 * MIB

    console = Console(width=200, record=True)
    console.print(bucket_table(result))
    text = console.export_text()
    assert "1st capture outside pool MiB" in text and "192.0" in text

    path = tmp_path / "sweep.png"
    plot_sweeps(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reports_without_first_capture_figures_still_print_and_plot(tmp_path: Path) -> None:
    result = sweep_json([_sweep("tuned", 0)], {"model": "m", "device": "d"})
    for m in result["policies"][0]["buckets"]:
        del m["first_device_bytes"], m["first_pool_bytes"], m["first_outside_pool_bytes"]
    console = Console(width=200, record=True)
    console.print(bucket_table(result))
    assert "—" in console.export_text()
    plot_sweeps(result, tmp_path / "old.png")
    assert (tmp_path / "old.png").stat().st_size > 0


def _fake_gpu_sweeps(monkeypatch: pytest.MonkeyPatch, refuse: set[str]) -> None:
    import torch

    import infer_cli.bench.bucket_sweep as bucket_sweep

    def sweep_policy(model: Path, policy: str, *args: object) -> PolicySweep:
        if policy in refuse:
            raise capture_out_of_memory(64, [], policy)
        return _sweep(policy, 0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bucket_sweep, "sweep_policy", sweep_policy)


def test_a_policy_whose_graphs_do_not_fit_is_refused_and_the_rest_are_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_gpu_sweeps(monkeypatch, refuse={"per-token"})
    console = Console(width=300, record=True)
    out = tmp_path / "sweep.json"
    run_bucket_bench("1,8,64", tmp_path, "tuned,per-token", 0.9, out, False, None, console)
    result = json.loads(out.read_text())
    assert [p["policy"] for p in result["policies"]] == ["tuned"]
    assert list(result["refused"]) == ["per-token"] and "at bucket 64" in result["refused"]["per-token"]
    assert "per-token: refused" in console.export_text()


def test_every_policy_refused_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu_sweeps(monkeypatch, refuse={"per-token"})
    with pytest.raises(typer.Exit) as stopped:
        run_bucket_bench("1,8", tmp_path, "per-token", 0.9, None, False, None, Console(record=True))
    assert stopped.value.exit_code == 2
