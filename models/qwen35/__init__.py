"""Qwen3.5 model line (Gated DeltaNet + gated full attention; text tower).

Loading is the shared `PagedLine`'s, with three facts of this line settled first, before any
weight is read: the GDN backend (`--gdn-backend`) for the device; prefix caching off (a KV page is
useless without the recurrent state at its position, and state snapshots are not built); and
`--async-prefill` refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import torch

from engine.forward_batch import PagedCausalLM
from kernels.gdn import GDNBackend, GDNBackendError, pick_gdn_backend
from kernels.gemm.dispatch import Linear
from models.device_choice import pick_device
from models.paged_line import PagedLine
from models.qwen35.config import MODEL_TYPES, Qwen35Config, parse_qwen35_config
from models.qwen35.model import Qwen35Model
from models.qwen35.weights import weight_map
from models.registry import LoadedModel, ModelLoadError, ModelOptions, register_model_types

log = logging.getLogger("infer.models")


class _WithBackend:
    """`Qwen35Model` with the GDN backend this load chose (the shared factory signature has no
    place for it)."""

    def __init__(self, gdn: GDNBackend) -> None:
        self.gdn = gdn

    def __call__(
        self,
        config: Qwen35Config,
        weights: Mapping[str, torch.Tensor],
        device: torch.device,
        max_positions: int,
        linear: Linear,
    ) -> PagedCausalLM:
        return Qwen35Model(config, weights, device, max_positions, linear, gdn=self.gdn)


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
    if engine.enable_prefix_caching:
        log.warning(
            "qwen3.5: prefix caching is off: a cached KV page is useless without the recurrent state "
            "at its position, and state snapshots are not built yet"
        )
        engine = dataclasses.replace(engine, enable_prefix_caching=False)
    return dataclasses.replace(options, engine=engine), gdn


def load_qwen35(spec: str, options: ModelOptions) -> LoadedModel:
    options, gdn = line_options(options)
    line = PagedLine(
        family="qwen35",
        model_types=MODEL_TYPES,
        parse_config=parse_qwen35_config,
        context_field="max_position_embeddings (text config)",
        weight_map=weight_map,
        build_model=_WithBackend(gdn),
    )
    return line.load(spec, options)


register_model_types(MODEL_TYPES, load_qwen35)
