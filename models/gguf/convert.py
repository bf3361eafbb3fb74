"""GGUF file -> Hugging Face checkpoint directory (config, tokenizer, safetensors).

Every tensor is checked before anything is written: its type is supported, its GGUF name stands
for exactly one Hugging Face tensor of the model transformers builds from the config, and its
shape is that tensor's. Tensors are then dequantized and written one at a time (peak memory: the
largest tensor), and the written directory goes through the project's checked loader
(models/checkpoint.py), which names every faulty tensor at once.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.progress import SILENT, ProgressSink, task
from models.checkpoint import TensorSpec as CheckedSpec
from models.checkpoint import WeightsError, check_tensors, stored_tensors
from models.gguf.architectures import Architecture, architecture, hf_values, match_names
from models.gguf.deps import import_gguf
from models.gguf.errors import GGUFError, GGUFTensorsError
from models.gguf.metadata import write_metadata
from models.gguf.tensors import dequantized, row_major_shape, source_dtype, type_name, unsupported
from models.synth.safetensors_stream import plan_shards, write_safetensors
from models.synth.tensors import TensorSpec, plan_tensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_WIDTH_ORDER = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class ConvertResult:
    out: Path
    architecture: str
    model_type: str
    num_tensors: int
    num_parameters: int
    total_bytes: int
    gguf_types: dict[str, int]  # GGUF tensor type -> how many tensors had it
    dtypes: dict[str, int]  # written dtype -> how many tensors have it
    weight_files: tuple[str, ...]
    seconds: float


def _open(path: Path) -> Any:
    gguf = import_gguf()
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc


def _string_field(reader: Any, path: Path, key: str) -> str:
    field = reader.get_field(key)
    if field is None:
        raise GGUFError(f"{path}: metadata field {key!r} is missing")
    value = field.contents()
    if not isinstance(value, str):
        raise GGUFError(f"{path}: metadata field {key!r} is not a string")
    return value


# What a conversion writes (transformers' tokenizer files included); --overwrite removes only these.
_OUTPUT_GLOBS = (
    "*.safetensors",
    INDEX_FILE,
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _remove_outputs(out: Path) -> None:
    for pattern in _OUTPUT_GLOBS:
        for file in out.glob(pattern):
            file.unlink()


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise GGUFError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise GGUFError(f"{out}: directory is not empty (pass overwrite to replace its checkpoint files)")
        _remove_outputs(out)
    out.mkdir(parents=True, exist_ok=True)


def _plan(
    path: Path, arch: Architecture, tensors: dict[str, Any], config: dict[str, Any], specs: list[TensorSpec]
) -> dict[str, Any]:
    """The GGUF tensor of each Hugging Face tensor; every mismatch named in one error."""
    num_layers = config.get("num_hidden_layers")
    if not isinstance(num_layers, int):
        raise GGUFError(f"{path}: the converted config has no integer 'num_hidden_layers'")
    match = match_names(arch, num_layers, [spec.name for spec in specs])
    problems = list(match.problems)
    gguf_of_hf = {hf_name: gguf_name for gguf_name, hf_name in match.hf_of_gguf.items()}
    source: dict[str, Any] = {}
    for spec in specs:
        gguf_name = gguf_of_hf.get(spec.name)
        if gguf_name is None:
            continue
        tensor = tensors.get(gguf_name)
        if tensor is None:
            problems.append(f"{spec.name}: missing (GGUF tensor {gguf_name} is not in the file)")
            continue
        shape = row_major_shape(tensor)
        if shape != spec.shape:
            problems.append(f"{gguf_name}: shape {list(shape)}, but {spec.name} is {list(spec.shape)}")
            continue
        source[spec.name] = tensor
    for gguf_name in sorted(set(tensors) - set(match.hf_of_gguf)):
        problems.append(f"{gguf_name}: no Hugging Face tensor of {config.get('model_type')} stands for it")
    if problems:
        raise GGUFTensorsError(path, problems)
    return source


def convert_gguf(
    path: Path,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    shard_bytes: int = 4 << 30,
    progress: ProgressSink = SILENT,
) -> ConvertResult:
    """Convert `path` into the directory `out`. `dtype` None keeps each tensor's own float type
    (quantized tensors: float32, where their dequantized values are exact)."""
    started = time.perf_counter()
    reader = _open(path)
    arch = architecture(path, _string_field(reader, path, "general.architecture"))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    refused = [why for tensor in tensors.values() if (why := unsupported(tensor)) is not None]
    if refused:
        raise GGUFTensorsError(path, refused)
    out_dtype = {name: dtype or source_dtype(tensor) for name, tensor in tensors.items()}
    present = set(out_dtype.values())
    widest = next((d for d in _WIDTH_ORDER if d in present), torch.float32)

    _prepare_out(out, overwrite)
    try:
        progress.note(f"{path.name}: config and tokenizer from the GGUF metadata (transformers)")
        config = write_metadata(path, out, widest)
        planned = plan_tensors(out, torch.float32)
        source = _plan(path, arch, tensors, config, planned)
        specs = [TensorSpec(s.name, s.shape, out_dtype[source[s.name].name]) for s in planned]

        def produce(spec: TensorSpec) -> torch.Tensor:
            tensor = source[spec.name]
            return hf_values(arch, tensor.name, dequantized(tensor), config).to(spec.dtype)

        shards = plan_shards(specs, shard_bytes)
        files = (
            [SINGLE_FILE]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        with task(progress, f"converting {path.name}", len(specs)):
            for file, shard in zip(files, shards, strict=True):
                write_safetensors(out / file, shard, produce, lambda spec: progress.advance(spec.name))
        if len(shards) > 1:
            weight_map = {
                spec.name: file for file, shard in zip(files, shards, strict=True) for spec in shard
            }
            body = {
                "metadata": {"total_size": sum(s.nbytes for s in specs)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (out / INDEX_FILE).write_text(json.dumps(body, indent=2) + "\n")

        expected = {spec.name: CheckedSpec(spec.shape, spec.dtype) for spec in specs}
        try:
            check_tensors(out, expected, stored_tensors(out))
        except WeightsError as exc:
            raise GGUFError(f"the converted directory fails the checkpoint check: {exc}") from exc
    except BaseException:
        _remove_outputs(out)  # no half-written checkpoint is left behind
        raise
    return ConvertResult(
        out=out,
        architecture=arch.name,
        model_type=str(config.get("model_type")),
        num_tensors=len(specs),
        num_parameters=sum(spec.numel for spec in specs),
        total_bytes=sum(spec.nbytes for spec in specs),
        gguf_types=dict(Counter(type_name(tensor) for tensor in tensors.values())),
        dtypes=dict(Counter(str(spec.dtype).removeprefix("torch.") for spec in specs)),
        weight_files=tuple(files),
        seconds=time.perf_counter() - started,
    )
