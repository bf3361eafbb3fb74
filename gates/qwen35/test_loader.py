"""The loader refuses a broken checkpoint and names every faulty tensor at once, GDN ones included."""

from __future__ import annotations

from pathlib import Path

from gates.harness.faulty_checkpoint import Faults, assert_loader_names_every_fault


def test_loader_names_every_faulty_tensor(checkpoint_path: Path, tmp_path: Path) -> None:
    faults = Faults(
        missing="model.layers.0.linear_attn.A_log",
        wrong_shape="model.layers.1.linear_attn.conv1d.weight",
        extra="model.layers.0.linear_attn.bogus_proj.weight",
    )
    assert_loader_names_every_fault(checkpoint_path, faults, tmp_path)
