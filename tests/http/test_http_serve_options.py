"""`infer serve`'s engine and model knobs are their dataclass fields: every field with a help is an
option, with the field's default, and the values given reach the ModelOptions the model loads with."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperGroup, TyperOption
from typer.testing import CliRunner

from engine.config import EngineConfig
from infer_cli import serve_cmd
from infer_cli.engine_options import KNOBS, Knobs, knob_options
from infer_cli.main import app
from models.context_limit import OPT_IN_ENV
from models.registry import LoadedModel, ModelLoadError, ModelOptions


def _options(*path: str) -> dict[str, TyperOption]:
    """The options of `infer PATH...`, by parameter name, as click sees them (typer 0.29's own click)."""
    command = typer.main.get_command(app)
    for name in path:
        assert isinstance(command, TyperGroup)
        command = command.commands[name]
    return {p.name: p for p in command.params if isinstance(p, TyperOption) and p.name}


def _knob_fields() -> list[tuple[type, dataclasses.Field[Any]]]:
    return [(owner, f) for owner in (EngineConfig, ModelOptions) for f in dataclasses.fields(owner)]


def _flag(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("flag", "--" + f.name.replace("_", "-")))


def _check_option(option: TyperOption, f: dataclasses.Field[Any]) -> None:
    where = f"option {option.opts} of field {f.name}"
    assert option.opts == [_flag(f)], where
    assert option.default == f.default, f"{where}: default {option.default!r}, field {f.default!r}"
    if f.default is True or f.metadata.get("negatable"):
        assert option.secondary_opts == ["--no-" + _flag(f).removeprefix("--")], where
    else:
        assert option.secondary_opts == [], where


def test_every_field_with_a_help_is_an_option_of_serve_with_the_fields_default() -> None:
    options = _options("serve")
    knob_fields = [(owner, f) for owner, f in _knob_fields() if "help" in f.metadata]
    assert {f.name for _, f in knob_fields} >= {"max_num_seqs", "numeric_policy", "dtype", "sim_step_delay_s"}
    for owner, f in knob_fields:
        assert f.name in options, f"{owner.__name__}.{f.name} has a help but is no option of `infer serve`"
        _check_option(options[f.name], f)
        assert options[f.name].help == f.metadata["help"]
    for owner, f in _knob_fields():
        if "help" not in f.metadata:
            assert f.name not in options, f"{owner.__name__}.{f.name} has no help, yet is an option"
    assert options["allow_long_max_model_len"].envvar == OPT_IN_ENV
    assert options["api_key"].envvar == "INFER_API_KEY"


def test_serve_help_lists_every_knob_with_its_help() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = re.sub(r"\s+", " ", result.output)
    for knob in KNOBS.values():
        assert knob.flag in text, knob.name
        assert knob.help in text, knob.name
    assert "--no-enable-prefix-caching" in text
    assert "[default: 256]" in text  # max_num_seqs: the real default, no longer None


def _load_options(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> ModelOptions:
    seen: list[ModelOptions] = []

    def fake_load(spec: str, options: ModelOptions) -> LoadedModel:
        seen.append(options)
        raise ModelLoadError("stopped by the test after the options were built")

    monkeypatch.setattr(serve_cmd, "load_model", fake_load)
    result = CliRunner().invoke(app, ["serve", "--model", "x", *args])
    assert result.exit_code == 2 and len(seen) == 1, result.output
    return seen[0]


def test_serve_hands_every_knob_to_the_model_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    assert _load_options(monkeypatch, []) == ModelOptions()
    options = _load_options(
        monkeypatch,
        [
            "--max-num-seqs", "7",
            "--max-num-batched-tokens", "99",
            "--max-model-len", "300",
            "--allow-long-max-model-len",
            "--num-kv-pages", "40",
            "--no-enable-prefix-caching",
            "--enforce-eager",
            "--gpu-memory-utilization", "0.5",
            "--kv-cache-memory", "12345",
            "--numeric-policy", "invariant",
            "--async-prefill",
            "--tensor-parallel-size", "2",
            "--collective-timeout", "5",
            "--sampling-backend", "triton",
            "--dtype", "float32",
            "--device", "cpu",
            "--attention-backend", "torch",
            "--decode-fusion",
            "--gdn-backend", "torch",
            "--sim-step-delay", "0.25",
        ],
    )  # fmt: skip
    expected_engine = EngineConfig(
        max_num_seqs=7,
        max_num_batched_tokens=99,
        max_model_len=300,
        allow_long_max_model_len=True,
        num_kv_pages=40,
        enable_prefix_caching=False,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        kv_cache_memory=12345,
        numeric_policy="invariant",
        async_prefill=True,
        tensor_parallel_size=2,
        collective_timeout_s=5.0,
        sampling_backend="triton",
    )
    assert options == ModelOptions(
        engine=expected_engine,
        dtype="float32",
        device="cpu",
        attention_backend="torch",
        decode_fusion=True,
        gdn_backend="torch",
        sim_step_delay_s=0.25,
    )
    # Async scheduling excludes --async-prefill, so it is set on its own, both ways.
    scheduled = _load_options(monkeypatch, ["--async-scheduling"])
    assert scheduled == ModelOptions(engine=EngineConfig(async_scheduling=True))
    assert _load_options(monkeypatch, ["--no-async-scheduling"]) == ModelOptions(
        engine=EngineConfig(async_scheduling=False)
    )
    assert _load_options(monkeypatch, []) == ModelOptions()  # None: on unless --async-prefill
    # Prefill graphs exclude --enforce-eager: on their own too.
    graphed = _load_options(monkeypatch, ["--prefill-graphs"])
    assert graphed == ModelOptions(engine=EngineConfig(prefill_graphs=True))
    # Every knob was set away from its default above: a knob added later is caught here until it is too.
    alone = {"async_scheduling": scheduled, "prefill_graphs": graphed}
    for name, knob in KNOBS.items():
        values = alone.get(name, options)
        value = getattr(values.engine if knob.owner is EngineConfig else values, name)
        assert value != knob.default, f"{name}: not exercised by this test"


def test_bench_commands_take_their_knobs_from_the_fields_and_keep_their_policy_lists() -> None:
    fields = {f.name: f for _, f in _knob_fields()}
    latency = _options("bench", "latency")
    for name in ("enforce_eager", "gpu_memory_utilization"):
        _check_option(latency[name], fields[name])
        assert latency[name].help == fields[name].metadata["help"]
    buckets = _options("bench")
    for name in ("gpu_memory_utilization", "attention_backend"):
        _check_option(buckets[name], fields[name])
        assert buckets[name].help == "--buckets: " + fields[name].metadata["help"]
    for name in ("tensor_parallel_size", "collective_timeout_s"):
        _check_option(latency[name], fields[name])
    _check_option(buckets["tensor_parallel_size"], fields["tensor_parallel_size"])
    gates = _options("gates")["tensor_parallel_size"]
    _check_option(gates, fields["tensor_parallel_size"])
    assert gates.help == "every gate's engines: " + fields["tensor_parallel_size"].metadata["help"]
    # --numeric-policy there is a comma-separated list of policies, not the engine knob.
    for options in (latency, buckets):
        policy = options["numeric_policy"]
        assert policy.default == "tuned" and policy.help is not None
        assert "comma-separated" in policy.help.lower()
        assert policy.help != fields["numeric_policy"].metadata["help"]


def test_knob_options_refuses_a_command_option_that_shadows_a_knob() -> None:
    def command(numeric_policy: str = typer.Option("tuned"), *, knobs: Knobs) -> None: ...

    with pytest.raises(TypeError, match="numeric_policy"):
        knob_options("numeric_policy")(command)
    with pytest.raises(KeyError, match="not_a_knob"):
        knob_options("not_a_knob")(command)
    with pytest.raises(KeyError, match="page_size"):
        Knobs({"page_size": 8})


def test_serve_refuses_a_split_that_does_not_divide_by_field_and_exits_2(tiny_qwen3: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["serve", "--model", str(tiny_qwen3), "--device", "cpu", "--tensor-parallel-size", "3"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 2, result.output
    assert "--tensor-parallel-size 3: field 'num_attention_heads' = 4" in " ".join(result.output.split())
    assert "Traceback" not in result.output
