"""The loader refuses a broken checkpoint and names every faulty tensor at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from gates.harness.faulty_checkpoint import Faults, write_faulty_copy
from gates.harness.serving import load_for_gate
from models.checkpoint import WeightsError


def test_loader_names_every_faulty_tensor(checkpoint_path: Path, tmp_path: Path) -> None:
    faults = Faults(
        missing="model.layers.0.input_layernorm.weight",
        wrong_shape="model.norm.weight",
        extra="model.layers.0.self_attn.bogus_proj.weight",
    )
    broken = tmp_path / "broken"
    write_faulty_copy(checkpoint_path, broken, faults)
    with pytest.raises(WeightsError) as info:
        load_for_gate(broken, num_kv_pages=16)
    message = str(info.value)
    for name in (faults.missing, faults.wrong_shape, faults.extra):
        assert name in message, f"{name} is not named in: {message}"
    assert len(info.value.problems) == 3, info.value.problems
