"""Qwen3.5 model line (Gated DeltaNet + gated full attention; text tower).

Loading is the shared `PagedLine`'s, with this line's facts settled around it. Before any weight is
read: the GDN backend (`--gdn-backend`) for the device, and whether it covers the checkpoint's GDN
geometry in the serving dtype; `--async-prefill` refused (`--async-scheduling` runs: the scheduler's
launched steps carry the state copies). Prefix caching runs with state snapshots at page boundaries
(engine/kv/snapshots.py; the engine takes and restores them, the model reads whatever state its slot
holds). After the model is built and before start-up sizes the KV pool or captures graphs: the
backend's `warm_up` at that geometry (`auto` measures and pins its per-phase choice there, fla
settles its Triton autotune), so neither the budget nor a graph sees a first-use compile.

At `--tensor-parallel-size N` > 1 the line runs split (docs/tensor-parallel.md): the parser and
the model builder travel to the worker ranks, so both are picklable values, not closures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engine.forward_batch import PagedCausalLM
from engine.parallel.group import SINGLE_RANK, RankGroup
from engine.parallel.sharding import ShardPlan
from engine.progress import SILENT, ProgressSink, task
from kernels.gdn import GDNBackend, GDNBackendError, pick_gdn_backend
from kernels.gemm.dispatch import Linear
from kernels.reference import SpecError
from models.device_choice import pick_device, pick_dtype
from models.paged_line import PagedLine, ShardedRuntime
from models.qwen35.config import MODEL_TYPES, GDNGeometry, Qwen35Config, parse_qwen35_config
from models.qwen35.model import Qwen35Model
from models.qwen35.sharding import shard_plan
from models.qwen35.weights import shard_slices, weight_map
from models.registry import LoadedModel, ModelLoadError, ModelOptions, register_model_types

log = logging.getLogger("infer.models")


class _WithBackend:
    """`Qwen35Model` with the GDN backend this load chose, warmed up at the geometry of the model's
    own heads (the shared factory signature has no place for either). One rank's or all of them."""

    def __init__(self, gdn: GDNBackend, progress: ProgressSink) -> None:
        self.gdn = gdn
        self.progress = progress

    def __reduce__(self) -> tuple[Any, ...]:
        # A worker rank reports no progress: rank 0 does.
        return (_WithBackend, (self.gdn, SILENT))

    def __call__(
        self,
        config: Qwen35Config,
        weights: Mapping[str, torch.Tensor],
        device: torch.device,
        max_positions: int,
        linear: Linear,
        *,
        plan: ShardPlan | None = None,
        group: RankGroup = SINGLE_RANK,
    ) -> PagedCausalLM:
        model = Qwen35Model(
            config, weights, device, max_positions, linear, gdn=self.gdn, plan=plan, group=group
        )
        warm_up_gdn(self.gdn, model.gdn_geometry, model.embed.dtype, device, self.progress)
        return model


def warm_up_gdn(
    gdn: GDNBackend, heads: GDNGeometry, dtype: torch.dtype, device: torch.device, progress: ProgressSink
) -> None:
    """The backend's warm-up at the model's GDN geometry (`heads`: a rank's share under tensor
    parallelism), then its choice in the log and as a start-up note."""
    geometry = heads.kernel_geometry()
    started = time.perf_counter()
    with task(progress, f"GDN kernels: warming up {gdn.name}", 1):
        gdn.warm_up(geometry, dtype, device)
        progress.advance()
    message = f"GDN backend: {gdn.describe()} ({time.perf_counter() - started:.1f} s warm-up on {device})"
    log.info("qwen3.5: %s", message)
    progress.note(message)


class _CheckedParser:
    """`parse_qwen35_config`, then the backend's refusal of a GDN geometry or dtype it does not
    cover: both before the first weight is read."""

    def __init__(self, gdn: GDNBackend, backend_option: str, dtype: torch.dtype) -> None:
        self.gdn = gdn
        self.backend_option = backend_option
        self.dtype = dtype

    def __call__(self, checkpoint: Path) -> Qwen35Config:
        config = parse_qwen35_config(checkpoint)
        try:
            self.gdn.check(config.gdn.kernel_geometry(), self.dtype)
        except SpecError as exc:
            raise ModelLoadError(f"--gdn-backend {self.backend_option}: {checkpoint}: {exc}") from exc
        return config


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
    return options, gdn


def load_qwen35(spec: str, options: ModelOptions) -> LoadedModel:
    options, gdn = line_options(options)
    build = _WithBackend(gdn, options.progress)
    line = PagedLine(
        family="qwen35",
        model_types=MODEL_TYPES,
        parse_config=_CheckedParser(gdn, options.gdn_backend, pick_dtype(options, pick_device(options))),
        context_field="max_position_embeddings (text config)",
        weight_map=weight_map,
        shard_plan=shard_plan,
        build_model=build,
        sharded=ShardedRuntime(shard_slices, build),
    )
    return line.load(spec, options)


register_model_types(MODEL_TYPES, load_qwen35)
