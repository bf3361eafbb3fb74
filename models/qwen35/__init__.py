"""Qwen3.5 model line (Gated DeltaNet + gated full attention; text tower).

Loading is the shared `PagedLine`'s, with this line's facts settled around it. Before any weight is
read: the GDN backend (`--gdn-backend`) for the device, and whether it covers the checkpoint's GDN
geometry in the serving dtype; `--async-prefill` refused (and `--async-scheduling`, by the
scheduler). Prefix caching runs with state snapshots at page boundaries (engine/kv/snapshots.py;
the engine takes and restores them, the model reads whatever state its slot holds). After the model is
built and before start-up sizes the KV pool or captures graphs: the backend's `warm_up` at that
geometry (`auto` measures and pins its per-phase choice there, fla settles its Triton autotune), so
neither the budget nor a graph sees a first-use compile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from engine.forward_batch import PagedCausalLM
from engine.progress import ProgressSink, task
from kernels.gdn import GDNBackend, GDNBackendError, pick_gdn_backend
from kernels.gemm.dispatch import Linear
from kernels.reference import SpecError
from models.device_choice import pick_device, pick_dtype
from models.paged_line import PagedLine
from models.qwen35.config import MODEL_TYPES, Qwen35Config, parse_qwen35_config
from models.qwen35.model import Qwen35Model
from models.qwen35.sharding import shard_plan
from models.qwen35.weights import weight_map
from models.registry import LoadedModel, ModelLoadError, ModelOptions, register_model_types

log = logging.getLogger("infer.models")


class _WithBackend:
    """`Qwen35Model` with the GDN backend this load chose, warmed up at the model's geometry (the
    shared factory signature has no place for either)."""

    def __init__(self, gdn: GDNBackend, progress: ProgressSink) -> None:
        self.gdn = gdn
        self.progress = progress

    def __call__(
        self,
        config: Qwen35Config,
        weights: Mapping[str, torch.Tensor],
        device: torch.device,
        max_positions: int,
        linear: Linear,
    ) -> PagedCausalLM:
        model = Qwen35Model(config, weights, device, max_positions, linear, gdn=self.gdn)
        warm_up_gdn(self.gdn, config, model.embed.dtype, device, self.progress)
        return model


def warm_up_gdn(
    gdn: GDNBackend, config: Qwen35Config, dtype: torch.dtype, device: torch.device, progress: ProgressSink
) -> None:
    """The backend's warm-up at this model's GDN geometry, then its choice in the log and as a
    start-up note."""
    geometry = config.gdn.kernel_geometry()
    started = time.perf_counter()
    with task(progress, f"GDN kernels: warming up {gdn.name}", 1):
        gdn.warm_up(geometry, dtype, device)
        progress.advance()
    message = f"GDN backend: {gdn.describe()} ({time.perf_counter() - started:.1f} s warm-up on {device})"
    log.info("qwen3.5: %s", message)
    progress.note(message)


def _checked_parser(gdn: GDNBackend, options: ModelOptions) -> Callable[[Path], Qwen35Config]:
    """`parse_qwen35_config`, then the backend's refusal of a GDN geometry or dtype it does not
    cover: both before the first weight is read."""

    def parse(checkpoint: Path) -> Qwen35Config:
        config = parse_qwen35_config(checkpoint)
        dtype = pick_dtype(options, pick_device(options))
        try:
            gdn.check(config.gdn.kernel_geometry(), dtype)
        except SpecError as exc:
            raise ModelLoadError(f"--gdn-backend {options.gdn_backend}: {checkpoint}: {exc}") from exc
        return config

    return parse


def line_options(options: ModelOptions) -> tuple[ModelOptions, GDNBackend]:
    """The options this line runs with, and its GDN backend; refuses what it cannot run."""
    engine = options.engine
    if engine.async_prefill:
        raise ModelLoadError(
            "--async-prefill is not supported for Qwen3.5 (the state slots are not built for it)"
        )
    try:
        gdn = pick_gdn_backend(options.gdn_backend, pick_device(options))
    except GDNBackendError as exc:
        raise ModelLoadError(str(exc)) from exc
    if engine.async_scheduling:
        raise ModelLoadError(
            "--async-scheduling is not supported for Qwen3.5 (state slots and snapshots are copied "
            "by synchronous steps only)"
        )
    return options, gdn


def load_qwen35(spec: str, options: ModelOptions) -> LoadedModel:
    options, gdn = line_options(options)
    line = PagedLine(
        family="qwen35",
        model_types=MODEL_TYPES,
        parse_config=_checked_parser(gdn, options),
        context_field="max_position_embeddings (text config)",
        weight_map=weight_map,
        shard_plan=shard_plan,
        build_model=_WithBackend(gdn, options.progress),
    )
    return line.load(spec, options)


register_model_types(MODEL_TYPES, load_qwen35)
