"""Reading Hugging Face safetensors checkpoints: every tensor checked before any is trusted.

A model line states the tensors it expects (name → shape, dtype); `load_checked` compares that with
what the checkpoint holds — one file or shards listed by `model.safetensors.index.json` — and names
every faulty tensor in one error: missing, unexpected, wrong shape, wrong dtype. Safetensors only:
no pickle, no remote code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.parallel.sharding import LayerSplit
from engine.progress import SILENT, ProgressSink, task

_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    # None accepts any floating dtype (it is cast to the serving dtype on load).
    dtype: torch.dtype | None = None
    # Loaded in this dtype instead of the serving dtype (Qwen3.5's fp32 A_log: never rounded down).
    load_dtype: torch.dtype | None = None


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Indices [start, stop) of one dimension: the part of a tensor one tensor-parallel rank reads."""

    dim: int
    start: int
    stop: int

    def read(self, stored: Any) -> torch.Tensor:
        """This part of a safetensors slice, without reading the rest, as a dense tensor of its own
        (a column range can come back as a strided view of whole rows, which kernels that need
        dense weights refuse and which keeps the rest of the rows alive)."""
        index = (slice(None),) * self.dim + (slice(self.start, self.stop),)
        return stored[index].contiguous()

    def parts(self) -> tuple[TensorSlice, ...]:
        return (self,)


@dataclass(frozen=True, slots=True)
class JoinedSlices:
    """Several ranges of one dimension, read in order and concatenated along it: a rank's part of a
    fused tensor whose sections each split by head (Qwen3.5's q | k | v conv channels)."""

    pieces: tuple[TensorSlice, ...]

    def __post_init__(self) -> None:
        if not self.pieces or len({piece.dim for piece in self.pieces}) != 1:
            raise ValueError(f"joined slices need one or more ranges of a single dimension: {self.pieces}")

    @property
    def dim(self) -> int:
        return self.pieces[0].dim

    def read(self, stored: Any) -> torch.Tensor:
        return torch.cat([piece.read(stored) for piece in self.pieces], dim=self.dim)

    def parts(self) -> tuple[TensorSlice, ...]:
        return self.pieces


# What one rank reads of a split tensor.
TensorPart = TensorSlice | JoinedSlices


def mlp_slices(layer_prefix: str, layer: LayerSplit, rank: int) -> dict[str, TensorSlice]:
    """One layer's SwiGLU MLP on ``rank`` under HF names: gate/up by output rows, down by input
    columns."""
    mlp = layer.mlp.span(rank)
    p = layer_prefix
    return {
        p + "mlp.gate_proj.weight": TensorSlice(0, mlp.start, mlp.stop),
        p + "mlp.up_proj.weight": TensorSlice(0, mlp.start, mlp.stop),
        p + "mlp.down_proj.weight": TensorSlice(1, mlp.start, mlp.stop),
    }


def attention_mlp_slices(
    layer_prefix: str, layer: LayerSplit, rank: int, head_dim: int, *, with_v: bool = True
) -> dict[str, TensorSlice]:
    """One dense decoder layer's slices on ``rank`` under HF names (``layer_prefix`` ends in
    ``layers.N.``): Q/K/V and gate/up by output rows, O and down by input columns. ``with_v``
    False: the layer has no v_proj (Gemma 4's K = V global layers)."""
    assert layer.attention is not None
    q = layer.attention.heads.span(rank)
    kv = layer.attention.shared.span(rank)
    d, p = head_dim, layer_prefix
    slices = {
        p + "self_attn.q_proj.weight": TensorSlice(0, q.start * d, q.stop * d),
        p + "self_attn.k_proj.weight": TensorSlice(0, kv.start * d, kv.stop * d),
        p + "self_attn.o_proj.weight": TensorSlice(1, q.start * d, q.stop * d),
        **mlp_slices(p, layer, rank),
    }
    if with_v:
        slices[p + "self_attn.v_proj.weight"] = TensorSlice(0, kv.start * d, kv.stop * d)
    return slices


@dataclass(frozen=True, slots=True)
class StoredTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path


class WeightsError(ValueError):
    """Every faulty tensor of a checkpoint, named at once."""

    def __init__(self, checkpoint: Path, problems: list[str]) -> None:
        listing = "\n  ".join(problems)
        super().__init__(f"{checkpoint}: {len(problems)} faulty tensor(s):\n  {listing}")
        self.checkpoint = checkpoint
        self.problems = problems


def tower_prefix(names: Iterable[str], nested: tuple[str, ...], default: str) -> str:
    """Where a checkpoint keeps one tower's tensors: the first prefix of `nested` that some name
    starts with (a multimodal checkpoint's text tower), else `default` (the tower alone)."""
    stored = list(names)
    for prefix in nested:
        if any(name.startswith(prefix) for name in stored):
            return prefix
    return default


def checkpoint_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(checkpoint, [f"{index.name}: no 'weight_map' object"])
        files = sorted({checkpoint / str(f) for f in weight_map.values()})
        missing = [f"shard {f.name} listed in {index.name} does not exist" for f in files if not f.is_file()]
        if missing:
            raise WeightsError(checkpoint, missing)
        return files
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in checkpoint.glob("*.bin")) + sorted(
            p.name for p in checkpoint.glob("*.pt")
        )
        why = f" (found {', '.join(pickles)}: pickle checkpoints are refused)" if pickles else ""
        raise WeightsError(checkpoint, [f"no *.safetensors files{why}"])
    return files


def stored_tensors(checkpoint: Path) -> dict[str, StoredTensor]:
    """Names, shapes and dtypes from the safetensors headers, without reading any data."""
    found: dict[str, StoredTensor] = {}
    for file in checkpoint_files(checkpoint):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 — safe_open is not a mapping
                sl = handle.get_slice(name)
                dtype = _DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise WeightsError(checkpoint, [f"{name}: unsupported dtype {sl.get_dtype()}"])
                found[name] = StoredTensor(name, tuple(sl.get_shape()), dtype, file)
    return found


def check_tensors(
    checkpoint: Path,
    expected: Mapping[str, TensorSpec],
    stored: Mapping[str, StoredTensor],
    ignore: Callable[[str], bool] = lambda _name: False,
) -> None:
    problems: list[str] = []
    for name, spec in expected.items():
        have = stored.get(name)
        if have is None:
            problems.append(f"{name}: missing (expected shape {list(spec.shape)})")
            continue
        if have.shape != spec.shape:
            problems.append(f"{name}: shape {list(have.shape)}, expected {list(spec.shape)}")
        if spec.dtype is None and not have.dtype.is_floating_point:
            problems.append(f"{name}: dtype {have.dtype}, expected a floating dtype")
        elif spec.dtype is not None and have.dtype != spec.dtype:
            problems.append(f"{name}: dtype {have.dtype}, expected {spec.dtype}")
    for name in sorted(set(stored) - set(expected)):
        if not ignore(name):
            problems.append(f"{name}: unexpected tensor (shape {list(stored[name].shape)})")
    if problems:
        raise WeightsError(checkpoint, problems)


def iter_tensors(
    stored: Mapping[str, StoredTensor],
    names: list[str],
    device: torch.device,
    dtype: torch.dtype,
    load_dtypes: Mapping[str, torch.dtype] | None = None,
    slices: Mapping[str, TensorPart] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield tensors one at a time (file by file) so peak host memory stays at one tensor, each in
    `dtype` or in its own `load_dtypes` entry; a name in `slices` reads only that part."""
    own = load_dtypes or {}
    parts = slices or {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(stored[name].file, []).append(name)
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in file_names:
                part = parts.get(name)
                tensor = handle.get_tensor(name) if part is None else part.read(handle.get_slice(name))
                yield name, tensor.to(device=device, dtype=own.get(name, dtype))


@dataclass(slots=True)
class WeightCache:
    """Tensors already read, keyed by (checkpoint file and its mtime, tensor name, device, dtype).
    A process that builds several engines over one checkpoint (a gate comparing two engine
    settings, a sweep over numeric policies) reads and uploads it once. Models never write their weights, so sharing the
    tensors between engines is safe; the cache keeps them alive for as long as it lives."""

    tensors: dict[tuple[str, str, str, torch.dtype, TensorPart | None], torch.Tensor] = field(
        default_factory=dict
    )
    reads: int = 0
    hits: int = 0

    @staticmethod
    def file_tag(file: Path) -> str:
        # The file's mtime is part of the name: a shard rewritten in place is read again.
        return f"{file.resolve()}@{file.stat().st_mtime_ns}"


_ACTIVE_CACHE: ContextVar[WeightCache | None] = ContextVar("infer_weight_cache", default=None)


@contextmanager
def reusing_weights(cache: WeightCache) -> Iterator[WeightCache]:
    """Within the block, `load_checked` serves tensors from `cache` (filling it as it reads).
    Checks still run on every load: a cached tensor is only returned for a name the new load
    expects and the checkpoint still holds."""
    token = _ACTIVE_CACHE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE_CACHE.reset(token)


def load_checked(
    checkpoint: Path,
    expected: Mapping[str, TensorSpec],
    stored: Mapping[str, StoredTensor],
    device: torch.device,
    dtype: torch.dtype,
    ignore: Callable[[str], bool] = lambda _name: False,
    progress: ProgressSink = SILENT,
    slices: Mapping[str, TensorPart] | None = None,
) -> dict[str, torch.Tensor]:
    """Check every tensor (naming all faults at once), then load the expected ones onto `device` in
    `dtype` (or their spec's `load_dtype`), one `progress` unit per tensor read. Tensors `ignore`
    accepts stay on disk. A tensor named in `slices` is checked whole and read only in part (a
    tensor-parallel rank's shard)."""
    parts = slices or {}
    unknown = sorted(set(parts) - set(expected))
    if unknown:
        raise ValueError(f"slices name tensors the checkpoint is not expected to hold: {unknown}")
    outside = [
        f"{name}: slice {part} outside shape {list(expected[name].shape)}"
        for name, joined in parts.items()
        for part in joined.parts()
        if not (
            part.dim < len(expected[name].shape)
            and 0 <= part.start < part.stop <= expected[name].shape[part.dim]
        )
    ]
    if outside:
        raise ValueError("; ".join(outside))
    check_tensors(checkpoint, expected, stored, ignore=ignore)
    load_dtypes = {n: s.load_dtype for n, s in expected.items() if s.load_dtype is not None}
    cache = _ACTIVE_CACHE.get()
    names = list(expected)
    weights: dict[str, torch.Tensor] = {}
    if cache is not None:
        tags = {file: WeightCache.file_tag(file) for file in {stored[name].file for name in names}}
        key_of = {
            name: (tags[stored[name].file], name, str(device), load_dtypes.get(name, dtype), parts.get(name))
            for name in names
        }
        weights = {name: cache.tensors[key_of[name]] for name in names if key_of[name] in cache.tensors}
        cache.hits += len(weights)
    missing = [name for name in names if name not in weights]
    with task(progress, f"loading {checkpoint.name}", len(missing)):
        for name, tensor in iter_tensors(stored, missing, device, dtype, load_dtypes, parts):
            weights[name] = tensor
            if cache is not None:
                cache.reads += 1
                cache.tensors[key_of[name]] = tensor
            progress.advance(name)
    return {name: weights[name] for name in names}
