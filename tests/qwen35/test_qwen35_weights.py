"""The Qwen3.5 loader names every faulty tensor at once: every kind of GDN tensor of a layer,
missing or misshapen, beside a misshapen full-attention tensor, all in one WeightsError."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from models.checkpoint import WeightsError
from models.registry import ModelOptions, load_model

GDN = "model.layers.0.linear_attn."
MISSING = [GDN + n for n in ("in_proj_qkv.weight", "dt_bias", "A_log", "norm.weight")]
# How each misshapen tensor is wrong: a conv of width 3 (the config says 4), a row short, a head
# too many, a column more.
MISSHAPEN = {
    GDN + "conv1d.weight": lambda t: t[..., 1:],
    GDN + "in_proj_z.weight": lambda t: t[1:],
    GDN + "in_proj_b.weight": lambda t: torch.cat([t, t[:1]]),
    GDN + "in_proj_a.weight": lambda t: t[:, 1:],
    GDN + "out_proj.weight": lambda t: torch.cat([t, t[:, :1]], dim=1),
    "model.layers.3.self_attn.q_proj.weight": lambda t: t[: t.shape[0] // 2],
}


def test_every_missing_or_misshapen_gdn_tensor_is_named_at_once(tiny_qwen35: Path, tmp_path: Path) -> None:
    tensors = load_file(str(tiny_qwen35 / "model.safetensors"))
    assert set(MISSING) | set(MISSHAPEN) <= set(tensors), (
        "the tiny checkpoint lacks a tensor this test breaks"
    )
    for name in MISSING:
        del tensors[name]
    for name, reshape in MISSHAPEN.items():
        tensors[name] = reshape(tensors[name]).contiguous()
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen35, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})

    with pytest.raises(WeightsError) as caught:
        load_model(str(broken), ModelOptions(engine=EngineConfig(num_kv_pages=16), device="cpu"))
    error = caught.value
    message = str(error)
    for name in (*MISSING, *MISSHAPEN):
        assert name in message, f"{name} is not named in: {message}"
    assert len(error.problems) == len(MISSING) + len(MISSHAPEN), error.problems
