"""A copy of a checkpoint with known faults, for loader gates: rewrites only the shards that hold
the tensors it touches and links everything else, so it is cheap even for real-size checkpoints.
`assert_loader_names_every_fault` is the loader gate's body every model suite shares."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gates.harness.serving import load_for_gate
from models.checkpoint import WeightsError, checkpoint_files


@dataclass(frozen=True, slots=True)
class Faults:
    missing: str
    wrong_shape: str
    extra: str


def write_faulty_copy(checkpoint: Path, out: Path, faults: Faults) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shards = checkpoint_files(checkpoint)
    touched = {faults.missing, faults.wrong_shape}
    for item in checkpoint.iterdir():
        if item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            (out / item.name).symlink_to(item.resolve())
    weight_map: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            names = list(handle.keys())
            weight_map.update(dict.fromkeys(names, shard.name))
            if not touched & set(names):
                (out / shard.name).symlink_to(shard.resolve())
                continue
            tensors = {n: handle.get_tensor(n) for n in names if n != faults.missing}
        if faults.wrong_shape in tensors:
            original = tensors[faults.wrong_shape]
            tensors[faults.wrong_shape] = torch.zeros(
                (original.shape[0] + 1, *original.shape[1:]), dtype=original.dtype
            )
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
    extra_file = "model-extra.safetensors"
    save_file({faults.extra: torch.zeros(4)}, str(out / extra_file), metadata={"format": "pt"})
    weight_map.pop(faults.missing, None)
    weight_map[faults.extra] = extra_file
    # Always indexed: the extra tensor lives in a shard of its own.
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def assert_loader_names_every_fault(checkpoint: Path, faults: Faults, scratch: Path) -> None:
    """Loading a copy of `checkpoint` with `faults` fails with one error naming all three and
    nothing else. The copy is removed afterwards: its rewritten shard is as large as the original
    (1 GB for Gemma 3 270M), and pytest keeps its temporary folders."""
    broken = scratch / "broken"
    try:
        write_faulty_copy(checkpoint, broken, faults)
        _assert_refused_by_name(broken, faults)
    finally:
        shutil.rmtree(broken, ignore_errors=True)


def _assert_refused_by_name(broken: Path, faults: Faults) -> None:
    try:
        load_for_gate(broken, num_kv_pages=16)
    except WeightsError as error:
        message = str(error)
        for name in (faults.missing, faults.wrong_shape, faults.extra):
            assert name in message, f"{name} is not named in: {message}"
        assert len(error.problems) == 3, error.problems
    else:
        raise AssertionError(f"a checkpoint with {faults} loaded without an error")
