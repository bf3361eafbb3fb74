"""Preflight: before any gate runs, every need of the selected gates must be met on this machine.

Each unmet need is one problem naming the need, why it is unmet and the gates that need it. The
checkpoint comes from --checkpoint, else INFER_TEST_CHECKPOINT; it must be a folder whose
config.json parses and names a model type the suite covers. A `gpus:N` need is met on a machine
without CUDA (N gloo ranks on the CPU) and, with CUDA, by N visible GPUs. A run at
`--tensor-parallel-size N` > 1 is checked as every engine it builds will be (models.registry.
check_tensor_parallel: the line runs sharded, a GPU per rank on CUDA, the config divides), from the
checkpoint's config alone, before anything loads.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gates.runner.manifest import Gate, Manifest
from gates.runner.model_types import checkpoint_types, covered_types, covers
from gates.runner.needs import CHECKPOINT, GPU, HF_REFERENCE, gpus_of
from gates.runner.problems import Problem

CHECKPOINT_ENV = "INFER_TEST_CHECKPOINT"


@dataclass(slots=True, frozen=True)
class CheckpointInfo:
    path: Path
    model_types: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class PreflightResult:
    problems: tuple[Problem, ...]
    checkpoint: CheckpointInfo | None


def checkpoint_argument(flag: Path | None, env: Mapping[str, str]) -> Path | None:
    if flag is not None:
        return flag
    raw = env.get(CHECKPOINT_ENV, "").strip()
    return Path(raw) if raw else None


def _inspect_checkpoint(path: Path | None, manifest: Manifest) -> tuple[CheckpointInfo | None, str | None]:
    """The checkpoint's model types, or why it cannot serve this suite."""
    if path is None:
        return None, f"no checkpoint given (pass --checkpoint PATH or set {CHECKPOINT_ENV})"
    resolved = path.expanduser().resolve()
    if not resolved.is_dir():
        return None, f"{path} does not exist or is not a folder"
    config_path = resolved / "config.json"
    if not config_path.is_file():
        return None, f"{path} has no config.json"
    try:
        config: Any = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"{config_path} does not parse: {exc}"
    if not isinstance(config, dict):
        return None, f"{config_path} is not a JSON object"
    types = checkpoint_types(config)
    if not types:
        return None, f"{config_path} names no model_type"
    if not covers(manifest.suite.model_types, types):
        accepted = ", ".join(covered_types(manifest.suite.model_types)) or "none"
        return None, (
            f"{path} is a {' / '.join(types)} checkpoint; suite {manifest.suite.name} covers {accepted}"
        )
    return CheckpointInfo(resolved, tuple(types)), None


def _hf_reference_unmet(model_types: Sequence[str]) -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    unknown = [t for t in model_types if t not in CONFIG_MAPPING_NAMES]
    if unknown:
        return f"transformers {transformers.__version__} does not know model type(s) {', '.join(unknown)}"
    return None


def _gpu_unmet() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def _gpus_unmet(ranks: int) -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return None  # the ranks are gloo processes on the CPU
    visible = torch.cuda.device_count()
    if visible < ranks:
        return (
            f"{ranks} ranks need a GPU each and {visible} {'is' if visible == 1 else 'are'} visible "
            "(torch.cuda.device_count())"
        )
    return None


TENSOR_PARALLEL_SUBJECT = "--tensor-parallel-size"


def _split_unmet(ranks: int, checkpoint: CheckpointInfo | None) -> str | None:
    """Why the gates' engines cannot run at `ranks`, as loading them would say it."""
    import torch

    from engine.config import EngineConfig
    from engine.parallel.sharding import ShardError
    from models.paged_line import check_rank_devices
    from models.registry import ModelLoadError, ModelOptions, check_tensor_parallel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = ModelOptions(engine=EngineConfig(tensor_parallel_size=ranks), device=device)
    try:
        if checkpoint is None:
            check_rank_devices(torch.device(device), ranks)
        else:
            check_tensor_parallel(checkpoint.path, options)
    except (ModelLoadError, ShardError) as exc:
        return str(exc)
    return None


def preflight(
    manifest: Manifest, selected: Sequence[Gate], checkpoint: Path | None, tensor_parallel_size: int = 1
) -> PreflightResult:
    needed_by: dict[str, list[str]] = {}
    for gate in selected:
        for need in manifest.base_needs(gate):
            needed_by.setdefault(need, []).append(gate.id)

    problems: list[Problem] = []

    def unmet(need: str, why: str) -> None:
        gates = ", ".join(needed_by[need])
        problems.append(Problem("preflight", need, f"{why}; needed by {gates}"))

    info: CheckpointInfo | None = None
    if CHECKPOINT in needed_by or HF_REFERENCE in needed_by:
        info, why = _inspect_checkpoint(checkpoint, manifest)
        if why is not None and CHECKPOINT in needed_by:
            unmet(CHECKPOINT, why)
    if HF_REFERENCE in needed_by:
        types = info.model_types if info is not None else manifest.suite.model_types
        why = _hf_reference_unmet(types)
        if why is not None:
            unmet(HF_REFERENCE, why)
    if GPU in needed_by:
        why = _gpu_unmet()
        if why is not None:
            unmet(GPU, why)
    for need in sorted(needed_by):
        ranks = gpus_of(need)
        if ranks is not None and (why := _gpus_unmet(ranks)) is not None:
            unmet(need, why)
    loads_checkpoint = CHECKPOINT in needed_by or HF_REFERENCE in needed_by
    if tensor_parallel_size > 1 and (info is not None or not loads_checkpoint):
        why = _split_unmet(tensor_parallel_size, info)
        if why is not None:
            gates = ", ".join(gate.id for gate in selected)
            problems.append(
                Problem(
                    "preflight", TENSOR_PARALLEL_SUBJECT, f"{why}; every selected gate runs at it ({gates})"
                )
            )
    return PreflightResult(tuple(problems), info)
