"""The loader refuses a broken checkpoint and names every faulty tensor at once, GDN ones included,
in either naming (`model.*` text-only, `model.language_model.*` in the published `qwen3_5` form)."""

from __future__ import annotations

from pathlib import Path

from gates.harness.faulty_checkpoint import Faults, assert_loader_names_every_fault
from models.qwen35.config import parse_qwen35_config
from models.qwen35.weights import text_prefix


def test_loader_names_every_faulty_tensor(checkpoint_path: Path, tmp_path: Path) -> None:
    layers = text_prefix(parse_qwen35_config(checkpoint_path)) + "layers."
    faults = Faults(
        missing=layers + "0.linear_attn.A_log",
        wrong_shape=layers + "1.linear_attn.conv1d.weight",
        extra=layers + "0.linear_attn.bogus_proj.weight",
    )
    assert_loader_names_every_fault(checkpoint_path, faults, tmp_path)
