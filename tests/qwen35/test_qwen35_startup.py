"""Start-up of the Qwen3.5 line and its GDN backend: the backend is warmed up at the checkpoint's
geometry before the state pool and the KV pool exist (so before anything is sized or captured),
its choice is reported, and a backend that does not cover the geometry is refused before any
weight is read (or, under `auto`, left out)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import models.qwen35
from engine.config import EngineConfig
from engine.kv.pools import KVPools
from engine.kv.state_pool import StatePools
from kernels.gdn import GDNGeometry, TorchGDN
from kernels.gdn.auto import AutoGDN
from kernels.gdn.flashinfer_backend import check_geometry
from kernels.reference import SpecError
from models.qwen35.config import parse_qwen35_config
from models.registry import ModelLoadError, ModelOptions, load_model


class _Notes:
    def __init__(self) -> None:
        self.notes: list[str] = []
        self.tasks: list[str] = []

    def start(self, label: str, total: float) -> None:
        self.tasks.append(label)

    def advance(self, detail: str = "", amount: float = 1) -> None:
        pass

    def finish(self) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)


class _Spy(TorchGDN):
    """The torch backend, recording what start-up asks of it beside the pools' allocations."""

    def __init__(self, events: list[tuple[str, object]]) -> None:
        super().__init__()
        self.events = events

    def check(self, geometry: GDNGeometry, dtype: torch.dtype) -> None:
        self.events.append(("check", (geometry, dtype)))

    def warm_up(self, geometry: GDNGeometry, dtype: torch.dtype, device: torch.device) -> None:
        self.events.append(("warm_up", (geometry, dtype, device.type)))


class _FlashInferGeometry(TorchGDN):
    """Torch's math behind FlashInfer's coverage check (head size 128, bf16/fp16 only)."""

    name = "flashinfer"

    def check(self, geometry: GDNGeometry, dtype: torch.dtype) -> None:
        check_geometry(geometry, dtype)

    def warm_up(self, geometry: GDNGeometry, dtype: torch.dtype, device: torch.device) -> None:
        raise AssertionError("a backend that does not cover the geometry must not be warmed up")


def test_warm_up_runs_at_the_checkpoint_geometry_before_any_pool_is_allocated(
    tiny_qwen35: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, object]] = []
    spy = _Spy(events)
    monkeypatch.setattr(models.qwen35, "pick_gdn_backend", lambda name, device: spy)
    for pool, label in ((StatePools, "state pool"), (KVPools, "kv pool")):
        original = pool.allocate

        def recording(self: object, *args: object, _original: object = original, _label: str = label) -> None:
            events.append((_label, None))
            _original(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(pool, "allocate", recording)

    notes = _Notes()
    load_model(
        str(tiny_qwen35),
        ModelOptions(engine=EngineConfig(num_kv_pages=16), device="cpu", progress=notes),
    )
    gdn = parse_qwen35_config(tiny_qwen35).gdn
    geometry = GDNGeometry(gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["check", "warm_up"], kinds
    assert {"state pool", "kv pool"} <= set(kinds[2:]), kinds
    assert events[0][1] == (geometry, torch.float32)
    assert events[1][1] == (geometry, torch.float32, "cpu")
    assert "GDN kernels: warming up torch" in notes.tasks
    assert any(n.startswith("GDN backend: torch") for n in notes.notes), notes.notes


def test_a_backend_that_does_not_cover_the_geometry_is_refused_before_weights(
    tiny_qwen35: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FlashInfer's GDN prefill takes bf16/fp16 at head size 128; the tiny checkpoint is fp32 at
    head size 16. The folder holds the config alone: getting past the check would fail on the
    missing tokenizer instead."""
    shutil.copy(tiny_qwen35 / "config.json", tmp_path / "config.json")
    monkeypatch.setattr(models.qwen35, "pick_gdn_backend", lambda name, device: _FlashInferGeometry())
    with pytest.raises(ModelLoadError, match=r"--gdn-backend flashinfer: .*head size 128 only, got K=16"):
        load_model(str(tmp_path), ModelOptions(device="cpu", gdn_backend="flashinfer"))
    config = json.loads((tiny_qwen35 / "config.json").read_text())
    head_size_128 = {"linear_key_head_dim": 128, "linear_value_head_dim": 128}
    (tmp_path / "config.json").write_text(json.dumps(config | head_size_128))
    with pytest.raises(ModelLoadError, match=r"bf16 or fp16 q/k/v, got torch.float32"):
        load_model(str(tmp_path), ModelOptions(device="cpu", gdn_backend="flashinfer"))


def test_auto_leaves_out_a_backend_that_does_not_cover_the_geometry() -> None:
    cpu = torch.device("cpu")
    torch_backend = TorchGDN()
    auto = AutoGDN(cpu, {"torch": torch_backend, "flashinfer": _FlashInferGeometry()})
    covered = GDNGeometry(key_heads=2, value_heads=4, key_dim=128, value_dim=128)
    with pytest.raises(SpecError, match="head size 128 only"):
        check_geometry(GDNGeometry(2, 4, 16, 16), torch.bfloat16)
    check_geometry(covered, torch.bfloat16)  # what FlashInfer covers passes its own check
    auto.warm_up(GDNGeometry(2, 4, 16, 16), torch.float32, cpu)
    assert auto.chosen == {"prefill": torch_backend, "decode": torch_backend}
    assert auto.describe() == "auto (prefill: torch, decode: torch)"


class _Covering(TorchGDN):
    """A backend standing in for fla or FlashInfer: covers every geometry, warms up instantly."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def test_auto_takes_the_recorded_choice_for_this_device_and_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 row of `RECORDED` (the 4B's geometry) is taken without a start-up measurement; any
    other geometry is measured (here: the measurement is refused, so reaching it fails the test)."""
    import kernels.gdn.auto as auto_module

    cpu = torch.device("cpu")
    backends = {"torch": TorchGDN(), "fla": _Covering("fla"), "flashinfer": _Covering("flashinfer")}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")

    def not_measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("auto measured a geometry it holds a recorded choice for")

    monkeypatch.setattr(AutoGDN, "_measure", not_measured)
    auto = AutoGDN(cpu, backends)
    auto.warm_up(GDNGeometry(16, 32, 128, 128), torch.bfloat16, cpu)
    assert auto.chosen == {"prefill": backends["flashinfer"], "decode": backends["fla"]}
    assert ("NVIDIA H200", GDNGeometry(16, 32, 128, 128)) in auto_module.RECORDED

    other = AutoGDN(cpu, backends)
    with pytest.raises(AssertionError, match="measured a geometry"):
        other.warm_up(GDNGeometry(16, 48, 128, 128), torch.bfloat16, cpu)


def test_the_roofline_counts_each_row_s_state(tiny_qwen35: Path) -> None:
    """A decode row reads and writes its slot's state in every GDN layer: the decode floor's
    per-row bytes (infer_cli/bench/latency.py) take the pool's bytes per slot."""
    engine = EngineConfig(max_num_seqs=2, num_kv_pages=32, max_num_batched_tokens=64)
    model = load_model(str(tiny_qwen35), ModelOptions(engine=engine, device="cpu")).scheduler.runner.model  # type: ignore[attr-defined]
    facts = model.roofline()
    assert facts.state_bytes_per_row == model.state.bytes_per_slot() > 0
