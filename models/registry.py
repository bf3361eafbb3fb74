"""Model lines register here by name (`sim`) or by `model_type` (for checkpoint directories).

`load_model` turns a `--model` argument into a `LoadedModel`: the scheduler the engine drives and
the tokenizer the frontend talks through.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from engine.config import EngineConfig
from engine.contract import Scheduler
from engine.progress import SILENT, ProgressSink


class ModelLoadError(ValueError):
    """The `--model` argument or its checkpoint cannot be served; the message names why."""


class PromptRenderError(ValueError):
    """A tokenizer refuses a client's prompt (e.g. the chat template rejects the conversation): the
    client's fault, answered with a 400, never a server error."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, as the checkpoint's own tokenizer encodes it (BOS included)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Apply the chat template with the generation prompt appended; BOS comes from the template."""
        ...


@dataclass(frozen=True, slots=True)
class ModelOptions:
    engine: EngineConfig = field(default_factory=EngineConfig)
    # A field's metadata "help" makes it a knob of `infer serve` (infer_cli/engine_options.py).
    dtype: str | None = field(default=None, metadata={"help": "Weight and activation dtype (model lines)."})
    device: str | None = field(default=None, metadata={"help": "Device to run on, e.g. cuda or cpu."})
    attention_backend: str | None = field(
        default=None,
        metadata={
            "help": "torch, flashinfer or triton (split-KV Triton decode; prefill by flashinfer, else torch)."
        },
    )
    decode_fusion: bool = field(
        default=False,
        metadata={
            "help": "Steps of ≤ 64 rows through the fused GEMV or MMA (tuned, CUDA): Qwen3, Qwen3.5 with "
            "norms, residual adds, SiLU·mul; Gemma 3, 4 with GELU-tanh·mul; every LM head; off by default "
            "(slower than the default kernels on an H100 for Qwen3-4B; docs/benchmarks/qwen3.md)."
        },
    )
    gdn_backend: str = field(
        default="auto",
        metadata={
            "help": "Gated DeltaNet kernels (Qwen3.5): auto (per phase, the fastest that agrees with the spec; torch on CPU), flashinfer, fla or torch."
        },
    )
    sim_step_delay_s: float = field(
        default=0.0,
        metadata={
            "help": "sim only: seconds each engine step sleeps, standing in for a forward.",
            "flag": "--sim-step-delay",
        },
    )
    # Where loading and start-up report what the user waits for (weights, kernels, graphs); not
    # part of what the options ask for, so it takes no part in comparing them.
    progress: ProgressSink = field(default=SILENT, compare=False)


@dataclass(slots=True)
class LoadedModel:
    name: str
    scheduler: Scheduler
    tokenizer: Tokenizer
    max_model_len: int


Loader = Callable[[str, ModelOptions], LoadedModel]
# Refuses (raises) what a loader would refuse of the options before it reads a weight, from the
# checkpoint's config alone.
SplitCheck = Callable[[str, ModelOptions], None]

_BY_NAME: dict[str, Loader] = {}
_BY_MODEL_TYPE: dict[str, Loader] = {}
_SPLIT_CHECK_BY_MODEL_TYPE: dict[str, SplitCheck] = {}


def register_name(name: str, loader: Loader) -> None:
    _BY_NAME[name] = loader


def register_model_types(
    model_types: Sequence[str], loader: Loader, check_split: SplitCheck | None = None
) -> None:
    for model_type in model_types:
        _BY_MODEL_TYPE[model_type] = loader
        if check_split is not None:
            _SPLIT_CHECK_BY_MODEL_TYPE[model_type] = check_split


def _register_builtin_lines() -> None:
    # Importing a line registers it; kept here so `registry` is the one list of what exists.
    import models.gemma3
    import models.gemma4
    import models.qwen3
    import models.qwen35
    import models.sim  # noqa: F401


def checkpoint_model_type(path: Path) -> str:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: no config.json (a Hugging Face checkpoint directory is expected)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from exc
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ModelLoadError(f"{config_path}: field 'model_type' is missing or not a string")
    return model_type


# What `infer serve` loads without `--model`: Gemma 3 270M, shipped as a package and converted once
# into the cache (models.gguf.embedded).
DEFAULT_MODEL = "gemma-3-270m"


@dataclass(frozen=True, slots=True)
class ResolvedCheckpoint:
    path: Path
    # The name clients see when it is not the directory's (a hub id, the embedded model's).
    name: str | None


def resolve_checkpoint(spec: str, progress: ProgressSink = SILENT) -> ResolvedCheckpoint:
    """The checkpoint directory a `--model` argument that is not a built-in line's name stands
    for: the embedded model, an existing directory, a hub id, or a GGUF file (converted once)."""
    from models.hub import resolve_hub_checkpoint  # models.hub imports this module

    if spec == DEFAULT_MODEL:
        from models.gguf import embedded_gemma3_dir

        return ResolvedCheckpoint(embedded_gemma3_dir(progress), spec)
    path = Path(spec)
    # A directory that exists wins over a hub id spelled the same.
    hub_path = None if path.exists() else resolve_hub_checkpoint(spec, progress)
    path = hub_path or path
    if path.suffix.lower() == ".gguf" and path.is_file():
        from models.gguf import converted_checkpoint

        path = converted_checkpoint(path, progress)
    if not path.exists():
        known = ", ".join(sorted([*_BY_NAME, DEFAULT_MODEL])) or "none"
        raise ModelLoadError(
            f"--model {spec!r}: neither a built-in model ({known}), an existing directory nor a hub id (ORG/NAME)"
        )
    return ResolvedCheckpoint(path, spec if hub_path is not None else None)


def load_model(spec: str, options: ModelOptions | None = None) -> LoadedModel:
    _register_builtin_lines()
    options = options or ModelOptions()
    if spec in _BY_NAME:
        return _BY_NAME[spec](spec, options)
    resolved = resolve_checkpoint(spec, options.progress)
    path = resolved.path
    model_type = checkpoint_model_type(path)
    loader = _BY_MODEL_TYPE.get(model_type)
    if loader is None:
        supported = ", ".join(sorted(_BY_MODEL_TYPE)) or "none yet"
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported (supported: {supported})")
    loaded = loader(str(path), options)
    if resolved.name is not None:
        loaded.name = resolved.name
    return loaded


def check_tensor_parallel(path: Path, options: ModelOptions) -> None:
    """Refuse `options.engine.tensor_parallel_size` for the checkpoint directory `path` as loading
    it would (the line does not run sharded, too few GPUs, a config field that does not divide:
    `ModelLoadError` or `ShardError`, naming it), reading only its config: a command that loads
    later, or many times (`infer gates`, `infer bench latency`), checks this before anything."""
    ranks = options.engine.tensor_parallel_size
    if ranks == 1:
        return
    _register_builtin_lines()
    model_type = checkpoint_model_type(path)
    check = _SPLIT_CHECK_BY_MODEL_TYPE.get(model_type)
    if check is None:
        raise ModelLoadError(
            f"--tensor-parallel-size {ranks}: model_type {model_type!r} does not run sharded"
        )
    check(str(path), options)
