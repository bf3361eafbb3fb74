"""The loader refuses a broken checkpoint and names every faulty tensor at once."""

from __future__ import annotations

from pathlib import Path

from gates.harness.faulty_checkpoint import Faults, assert_loader_names_every_fault
from models.checkpoint import stored_tensors
from models.gemma3.config import GLOBAL, Gemma3Config
from models.gemma3.weights import text_prefix


def test_loader_names_every_faulty_tensor(
    checkpoint_path: Path, gemma3_config: Gemma3Config, tmp_path: Path
) -> None:
    """A global layer without its v_proj (Gemma 3 has no K = V), a misshapen Q norm, and a Gemma 4
    per-layer scalar that Gemma 3 has no use for are all named in one error."""
    prefix = text_prefix(stored_tensors(checkpoint_path))
    full = gemma3_config.layers_of(GLOBAL)[0]
    faults = Faults(
        missing=f"{prefix}layers.{full}.self_attn.v_proj.weight",
        wrong_shape=f"{prefix}layers.0.self_attn.q_norm.weight",
        extra=f"{prefix}layers.0.layer_scalar",
    )
    assert_loader_names_every_fault(checkpoint_path, faults, tmp_path)
