"""`infer bench table` on a checked-in H200 result: the figures the bench wrote, vLLM beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from infer_cli.bench.target_table import (
    Column,
    ResultFileError,
    load_latency_run,
    load_vllm_decode,
    target_rows,
)
from infer_cli.main import app

DATA = Path(__file__).resolve().parents[2] / "docs/benchmarks/data"
F348 = DATA / "2026-12-03-qwen3-4b-latency-h200-f348b1c.json"


def test_each_cell_is_the_bench_own_percent_of_floor() -> None:
    saved = json.loads(F348.read_text())
    run = load_latency_run(F348, "f348b1c")
    for row in saved["decode"]:
        assert run.cells[Column("decode", row["batch"])].pct == pytest.approx(row["pct_of_floor"])
    for row in saved["prefill"]:
        assert run.cells[Column("prefill", row["tokens"])].pct == pytest.approx(row["pct_of_floor"])
    # The breakdown read back is the one the bench wrote (its saved host gap included).
    for row in saved["decode"] + saved["prefill"]:
        key = Column("decode", row["batch"]) if "batch" in row else Column("prefill", row["tokens"])
        breakdown = run.cells[key].breakdown
        assert breakdown is not None
        assert breakdown.host_gap_ms == pytest.approx(row["breakdown"]["host_gap_ms"])
        assert dict(breakdown.by_category) == dict(map(tuple, row["breakdown"]["by_category"]))


def test_table_rows_targets_vllm_ratio_and_met(tmp_path: Path) -> None:
    vllm_file = tmp_path / "vllm.json"
    vllm_file.write_text(
        json.dumps(
            {"rows": [{"batch": 1, "decode_ms_per_step": 2.0}, {"batch": 64, "decode_ms_per_step": 14.362}]}
        )
    )
    run = load_latency_run(F348, "f348b1c")
    header, rows = target_rows([run], load_vllm_decode(vllm_file))
    assert header == ["", "batch 1", "batch 8", "batch 64", "prefill 1k", "prefill 8k"]
    by_name = {row[0]: row[1:] for row in rows}
    assert by_name["target"] == ["≥ 85 %", "≥ 80 %", "≥ 70 %", "≥ 50 %", "≥ 75 %"]
    assert by_name["infer step, f348b1c"][0] == "4.09 ms (46.7 %)"  # the file predates the stream floor
    # 4.092 / 2.0 at batch 1, 7.181 / 14.362 at batch 64; no vLLM figure at batch 8 or for prefill.
    assert by_name["infer / vLLM, f348b1c"] == ["2.05", "", "0.50", "", ""]
    assert by_name["met, f348b1c"] == ["no", "no", "no", "no", "yes"]


def test_refuses_files_it_cannot_read_by_name(tmp_path: Path) -> None:
    not_latency = tmp_path / "other.json"
    not_latency.write_text(json.dumps({"rows": []}))
    with pytest.raises(ResultFileError, match=r"other\.json: no 'decode' field"):
        load_latency_run(not_latency)
    with pytest.raises(ResultFileError, match="no decode or prefill row under policy 'invariant'"):
        load_latency_run(F348, policy="invariant")
    with pytest.raises(ResultFileError, match=r"other\.json: no 'rows' list"):
        load_vllm_decode(not_latency)
    saved = json.loads(F348.read_text())
    del saved["decode"][0]["breakdown"]["busy_ms"]
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(saved))
    with pytest.raises(ResultFileError, match=r"damaged\.json: a breakdown that cannot be read .*busy_ms"):
        load_latency_run(damaged)


def test_command_prints_markdown_with_labels(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "table", f"f348b1c={F348}", "--markdown"])
    assert result.exit_code == 0, result.output
    assert "| infer step, f348b1c | 4.09 ms (46.7 %) |" in result.output
    assert "| f348b1c | prefill 1k | 54.027 | 14.214 | 39.813 | 418 |  |" in result.output
    # The error itself, not its rendering: rich wraps and cuts long paths at a narrow terminal.
    bad = CliRunner().invoke(app, ["bench", "table", str(tmp_path / "missing.json")], standalone_mode=False)
    assert isinstance(bad.exception, typer.BadParameter) and "missing.json" in str(bad.exception)
