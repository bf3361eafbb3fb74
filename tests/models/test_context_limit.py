"""The context ceiling: the config's default, lowered freely, raised only with the opt-in (vLLM's rule)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.config import EngineConfig
from infer_cli import serve_cmd
from infer_cli.main import app
from models.context_limit import OPT_IN_ENV, resolve_max_model_len
from models.qwen3.model import Qwen3Model
from models.registry import LoadedModel, ModelLoadError, ModelOptions, load_model

FIELD = "max_position_embeddings"


@pytest.mark.parametrize("allow", [False, True])
def test_default_and_lower_ceilings_need_no_opt_in(allow: bool) -> None:
    assert resolve_max_model_len(None, 4096, FIELD, allow) == 4096
    assert resolve_max_model_len(4096, 4096, FIELD, allow) == 4096
    assert resolve_max_model_len(1, 4096, FIELD, allow) == 1


def test_raising_without_the_opt_in_is_refused_naming_both_values() -> None:
    with pytest.raises(ModelLoadError) as info:
        resolve_max_model_len(4097, 4096, FIELD, allow_long=False)
    message = str(info.value)
    assert "max_model_len = 4097" in message
    assert "max_position_embeddings = 4096" in message
    assert "--allow-long-max-model-len" in message and OPT_IN_ENV in message


def test_raising_with_the_opt_in_is_served_as_asked() -> None:
    assert resolve_max_model_len(4096 + 48, 4096, FIELD, allow_long=True) == 4144


@pytest.mark.parametrize("requested, default", [(0, 4096), (-3, 4096), (16, 0)])
def test_non_positive_values_are_refused_by_value(requested: int, default: int) -> None:
    with pytest.raises(ModelLoadError, match=f"= {requested if requested < 1 else default}:"):
        resolve_max_model_len(requested, default, FIELD, allow_long=True)


def _tiny_default(checkpoint: Path) -> int:
    from models.qwen3.config import parse_qwen3_config

    return parse_qwen3_config(checkpoint).max_position_embeddings


def test_qwen3_line_refuses_before_loading_weights(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal comes before any weight or KV page exists: loading weights would fail the test."""

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were loaded before the context ceiling was checked")

    monkeypatch.setattr("models.paged_line.load_checked", no_weights)
    default = _tiny_default(tiny_qwen3)
    engine = EngineConfig(max_model_len=default + 1, num_kv_pages=16)
    with pytest.raises(ModelLoadError, match=f"max_model_len = {default + 1} .* {FIELD} = {default}"):
        load_model(str(tiny_qwen3), ModelOptions(engine=engine, device="cpu"))


def test_qwen3_line_serves_the_raised_ceiling_with_rope_for_it(tiny_qwen3: Path) -> None:
    default = _tiny_default(tiny_qwen3)
    engine = EngineConfig(max_model_len=default + 32, allow_long_max_model_len=True, num_kv_pages=16)
    loaded = load_model(str(tiny_qwen3), ModelOptions(engine=engine, device="cpu"))
    assert loaded.max_model_len == default + 32
    model = loaded.scheduler.runner.model  # type: ignore[attr-defined]
    assert isinstance(model, Qwen3Model)
    assert model.rope_table.shape[0] >= default + 32, model.rope_table.shape


def _captured_engine(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[int, EngineConfig]:
    """Runs `infer serve` up to its model load, which is replaced by one that records the options."""
    seen: list[EngineConfig] = []

    def fake_load(spec: str, options: ModelOptions) -> LoadedModel:
        seen.append(options.engine)
        raise ModelLoadError("stopped by the test after the options were built")

    monkeypatch.setattr(serve_cmd, "load_model", fake_load)
    result = CliRunner().invoke(app, ["serve", "--model", "x", *args])
    assert len(seen) == 1, result.output
    return result.exit_code, seen[0]


def test_serve_flag_and_env_var_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    _, engine = _captured_engine(monkeypatch, ["--max-model-len", "9000"])
    assert (engine.max_model_len, engine.allow_long_max_model_len) == (9000, False)
    _, engine = _captured_engine(monkeypatch, ["--max-model-len", "9000", "--allow-long-max-model-len"])
    assert engine.allow_long_max_model_len
    monkeypatch.setenv(OPT_IN_ENV, "1")
    _, engine = _captured_engine(monkeypatch, ["--max-model-len", "9000"])
    assert engine.allow_long_max_model_len


def test_serve_prints_the_refusal_cleanly(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    default = _tiny_default(tiny_qwen3)
    result = CliRunner().invoke(
        app, ["serve", "--model", str(tiny_qwen3), "--device", "cpu", "--max-model-len", str(default + 16)]
    )
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    assert f"max_model_len = {default + 16}" in flat and f"{FIELD} = {default}" in flat, flat
