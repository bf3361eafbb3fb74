"""Write a synthetic Hugging Face checkpoint directory.

Order: tokenizer first (its ids go into the configs), then config.json and
generation_config.json (and, in the published form, the processor files), then the tensor list
read back from that config.json through transformers, then the weights streamed into safetensors
shards. Both forms write the same tokenizer, the same text config and the same text weights for
a seed; the published form nests them beside a vision tower (docs/synth.md, "Forms").
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from engine.progress import SILENT, ProgressSink, task
from models.synth.config_build import config_body, generation_body, published_config_body
from models.synth.errors import OutputDirError, SynthError, UnsupportedFormError
from models.synth.families import get_family
from models.synth.family import CheckpointForm, Family, InitRule, MultimodalForm, Preset, TokenizerKind
from models.synth.hf import import_transformers
from models.synth.multimodal import PROCESSOR_FILES, vision_config_body, write_processor_files
from models.synth.safetensors_stream import plan_shards, write_safetensors
from models.synth.tensors import DTYPES, TensorSpec, materialise, plan_tensors, rule_for
from models.synth.tokenizer_build import build_tokenizer, real_vocab_size

# Published checkpoints ship shards of a few GB; 4 GiB keeps each file under common upload limits.
DEFAULT_SHARD_BYTES = 4 << 30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WRITTEN_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    INDEX_FILE,
    *PROCESSOR_FILES,
)

DeviceChoice = Literal["auto", "cpu", "cuda"]
TokenizerChoice = Literal["auto", "real", "trained"]


@dataclass(slots=True, frozen=True)
class SynthRequest:
    family: str
    preset: str
    out: Path
    seed: int = 0
    dtype: str | None = None
    device: DeviceChoice = "auto"
    tokenizer: TokenizerChoice = "auto"
    overwrite: bool = False
    shard_bytes: int = DEFAULT_SHARD_BYTES
    form: CheckpointForm = "text"


@dataclass(slots=True, frozen=True)
class SynthPlan:
    """Everything decided before a byte of weights is written."""

    family: Family
    preset: Preset
    dtype: str
    device: torch.device
    tokenizer: TokenizerKind
    vocab_size: int
    # Set exactly for the published form.
    multimodal: MultimodalForm | None

    @property
    def model_type(self) -> str:
        return self.family.model_type if self.multimodal is None else self.multimodal.model_type


@dataclass(slots=True, frozen=True)
class SynthResult:
    out: Path
    family: str
    preset: str
    form: CheckpointForm
    model_type: str
    dtype: str
    device: str
    tokenizer: TokenizerKind
    vocab_size: int
    tokenizer_size: int
    num_tensors: int
    num_parameters: int
    total_bytes: int
    weight_files: tuple[str, ...]
    seconds: float


def _resolve_device(choice: DeviceChoice, preset: Preset) -> torch.device:
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise SynthError("--device cuda: no CUDA device is available")
        return torch.device("cuda")
    # Tiny checkpoints draw on the CPU everywhere, so a CPU box and a GPU box write the same bits.
    if preset.small or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def _resolve_tokenizer(choice: TokenizerChoice, family: Family, preset: Preset) -> TokenizerKind:
    if choice == "trained":
        return "trained"
    if choice == "real":
        if family.real_vocab is None:
            raise SynthError(
                f"no installable package ships the {family.name} vocabulary; use --tokenizer trained"
            )
        return "real"
    return preset.default_tokenizer if family.real_vocab is not None else "trained"


def _resolve_form(form: str, family: Family, preset: Preset) -> MultimodalForm | None:
    if form not in family.forms():
        raise UnsupportedFormError(family.name, form, family.forms())
    if form != "published" or family.multimodal is None:
        return None
    if preset.name not in family.multimodal.vision_fields:
        raise SynthError(f"--form published: preset {preset.name} of {family.name} has no vision tower")
    return family.multimodal


def plan(request: SynthRequest) -> SynthPlan:
    family = get_family(request.family)
    preset = family.preset(request.preset)
    multimodal = _resolve_form(request.form, family, preset)
    dtype = request.dtype or preset.default_dtype
    if dtype not in DTYPES:
        raise SynthError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    tokenizer = _resolve_tokenizer(request.tokenizer, family, preset)
    vocab_size = preset.vocab_size
    if tokenizer == "real" and family.real_vocab is not None and real_vocab_size(family) > vocab_size:
        # A small preset with the real vocabulary: the embedding grows to the published size.
        vocab_size = family.real_vocab.padded_vocab_size
    return SynthPlan(
        family, preset, dtype, _resolve_device(request.device, preset), tokenizer, vocab_size, multimodal
    )


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputDirError(str(out), "it is a file")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise OutputDirError(
                str(out), "the directory is not empty (pass --overwrite to replace a checkpoint)"
            )
        # Only what a checkpoint consists of is removed, never the rest of the folder.
        for entry in out.iterdir():
            if entry.is_file() and (entry.name in _WRITTEN_NAMES or entry.name.endswith(".safetensors")):
                entry.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _available_memory() -> int | None:
    """Bytes the kernel can hand out now, page cache included (a box that just wrote a checkpoint
    has little "free" memory but plenty available); None where it cannot be told."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    if hasattr(os, "sysconf"):
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return None


def _check_resources(out: Path, specs: list[TensorSpec], device: torch.device) -> None:
    total = sum(spec.nbytes for spec in specs)
    free_disk = shutil.disk_usage(out).free
    if free_disk < total:
        raise SynthError(
            f"{out}: the weights need {total / 1e9:.1f} GB of disk, {free_disk / 1e9:.1f} GB is free"
        )
    # The largest tensor is drawn in float32 and then cast: two copies of it at the peak.
    largest = max(specs, key=lambda spec: spec.numel)
    peak = largest.numel * (4 + largest.dtype.itemsize)
    if device.type == "cuda":
        free_device, _ = torch.cuda.mem_get_info(device)
        if free_device < peak:
            raise SynthError(
                f"{largest.name} needs {peak / 1e9:.1f} GB of device memory to draw, {free_device / 1e9:.1f} GB is free"
            )
    available = _available_memory()
    if available is not None and available < peak:
        raise SynthError(
            f"{largest.name} needs {peak / 1e9:.1f} GB of memory to draw, {available / 1e9:.1f} GB is free"
        )


def _write_json(path: Path, body: dict[str, Any]) -> None:
    path.write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n")


def _rules_of(name: str, family: Family, multimodal: MultimodalForm | None) -> tuple[InitRule, ...]:
    """The vision tower draws by its own rules, the text tower by the family's."""
    if multimodal is not None and name.startswith(multimodal.vision_prefix):
        return multimodal.vision_init_rules
    return family.init_rules


def synthesize(request: SynthRequest, progress: ProgressSink = SILENT) -> SynthResult:
    """Write the checkpoint; `progress` hears one task whose units are bytes, one advance a tensor."""
    started = time.monotonic()
    transformers = import_transformers()
    decided = plan(request)
    family, preset = decided.family, decided.preset
    max_len = int(preset.fields["max_position_embeddings"])
    built = build_tokenizer(family, decided.tokenizer, decided.vocab_size, max_len)

    out = request.out
    _prepare_out(out, request.overwrite)
    (out / "tokenizer.json").write_text(built.to_json())
    _write_json(out / "tokenizer_config.json", dict(built.config))
    version = str(transformers.__version__)
    config = config_body(family, preset, decided.vocab_size, built, decided.dtype, version)
    multimodal = decided.multimodal
    if multimodal is not None:
        vision = vision_config_body(multimodal, preset.name, int(preset.fields["hidden_size"]))
        config = published_config_body(family, multimodal, config, vision, built)
        write_processor_files(out, multimodal, vision, family.chat_template)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_body(family, built, version))

    dtype = DTYPES[decided.dtype]
    specs = plan_tensors(out, dtype)
    _check_resources(out, specs, decided.device)
    std = float(preset.fields["initializer_range"])
    rules = {spec.name: rule_for(spec, _rules_of(spec.name, family, multimodal), std) for spec in specs}
    seed_names = {
        spec.name: spec.name if multimodal is None else multimodal.seed_name(spec.name) for spec in specs
    }
    total = sum(spec.nbytes for spec in specs)

    shards = plan_shards(specs, request.shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    with task(progress, f"{len(specs)} tensors", total):
        for name, shard in zip(names, shards, strict=True):
            write_safetensors(
                out / name,
                shard,
                lambda spec: materialise(
                    spec, rules[spec.name], request.seed, decided.device, seed_names[spec.name]
                ),
                lambda spec: progress.advance(spec.name, spec.nbytes),
            )
    if len(shards) > 1:
        weight_map = {spec.name: name for name, shard in zip(names, shards, strict=True) for spec in shard}
        _write_json(
            out / INDEX_FILE,
            {
                "metadata": {"total_size": total, "total_parameters": sum(s.numel for s in specs)},
                "weight_map": dict(sorted(weight_map.items())),
            },
        )
    return SynthResult(
        out=out,
        family=family.name,
        preset=preset.name,
        form=request.form,
        model_type=decided.model_type,
        dtype=decided.dtype,
        device=str(decided.device),
        tokenizer=decided.tokenizer,
        vocab_size=decided.vocab_size,
        tokenizer_size=built.size,
        num_tensors=len(specs),
        num_parameters=sum(spec.numel for spec in specs),
        total_bytes=total,
        weight_files=tuple(names),
        seconds=time.monotonic() - started,
    )
