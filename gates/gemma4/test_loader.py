"""The loader refuses a broken checkpoint and names every faulty tensor at once."""

from __future__ import annotations

from pathlib import Path

from gates.harness.faulty_checkpoint import Faults, assert_loader_names_every_fault
from models.checkpoint import stored_tensors
from models.gemma4.config import GLOBAL, SLIDING, Gemma4Config
from models.gemma4.weights import text_prefix


def test_loader_names_every_faulty_tensor(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tmp_path: Path
) -> None:
    """A sliding layer without its v_proj, a misshapen final norm, and a v_proj on a global layer
    (where V is the raw K projection) are all named in one error."""
    prefix = text_prefix(stored_tensors(checkpoint_path))
    sliding = gemma4_config.layers_of(SLIDING)[0]
    full = gemma4_config.layers_of(GLOBAL)[0]
    faults = Faults(
        missing=f"{prefix}layers.{sliding}.self_attn.v_proj.weight",
        wrong_shape=f"{prefix}norm.weight",
        extra=f"{prefix}layers.{full}.self_attn.v_proj.weight",
    )
    assert_loader_names_every_fault(checkpoint_path, faults, tmp_path)
