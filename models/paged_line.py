"""One builder for every paged model line: a line states its facts in a `PagedLine`, and `load`
turns a checkpoint directory into a served `LoadedModel` the same way for all of them.

In order, before any weight is read: the config (fail-closed), device, dtype, tokenizer and context
ceiling; then every tensor is checked and loaded; then the model is built, start-up sizes its KV
groups on the device (engine.paged_startup) and the scheduler gets the groups start-up sized.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import torch

from engine.forward_batch import PagedCausalLM
from engine.kv.state_pool import state_pools_of
from engine.paged_startup import start_paged_model
from engine.scheduler import BatchScheduler
from kernels.gemm.dispatch import Linear, policy_linear
from kernels.kv_layout import pages_for
from models.checkpoint import StoredTensor, TensorSpec, load_checked, stored_tensors
from models.context_limit import resolve_max_model_len
from models.device_choice import pick_attention, pick_device, pick_dtype
from models.hf_tokenizer import HFTokenizer
from models.registry import LoadedModel, ModelOptions, register_model_types

log = logging.getLogger("infer.models")


class LineConfig(Protocol):
    """What the builder reads of every line's parsed config."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...


ConfigT = TypeVar("ConfigT", bound=LineConfig)
ConfigIn = TypeVar("ConfigIn", bound=LineConfig, contravariant=True)


@dataclass(frozen=True, slots=True)
class WeightMap:
    """The tensors a checkpoint must hold (checked all at once), and the stored ones to leave on
    disk without complaint (another tower's, a tied head's copy)."""

    expected: Mapping[str, TensorSpec]
    skip: Callable[[str], bool]


class ModelFactory(Protocol[ConfigIn]):
    def __call__(
        self,
        config: ConfigIn,
        weights: Mapping[str, torch.Tensor],
        device: torch.device,
        max_positions: int,
        linear: Linear,
    ) -> PagedCausalLM: ...


@dataclass(frozen=True, slots=True)
class PagedLine(Generic[ConfigT]):
    """A model line's facts: the model types it serves, how to parse and check a checkpoint of
    them, and the model class. `context_field` names the context ceiling in a refusal."""

    family: str
    model_types: tuple[str, ...]
    parse_config: Callable[[Path], ConfigT]
    context_field: str
    weight_map: Callable[[ConfigT, Mapping[str, StoredTensor]], WeightMap]
    build_model: ModelFactory[ConfigT]

    def load(self, spec: str, options: ModelOptions) -> LoadedModel:
        path = Path(spec)
        config = self.parse_config(path)
        device = pick_device(options)
        dtype = pick_dtype(options, device)
        tokenizer = HFTokenizer(path)
        engine = options.engine
        max_model_len = resolve_max_model_len(
            engine.max_model_len,
            config.max_position_embeddings,
            self.context_field,
            engine.allow_long_max_model_len,
        )
        stored = stored_tensors(path)
        wanted = self.weight_map(config, stored)
        weights = load_checked(
            path, wanted.expected, stored, device, dtype, ignore=wanted.skip, progress=options.progress
        )
        log.info(
            "%s: %d tensors resident (%.1f MiB, %s on %s), %d stored tensors skipped",
            path.name,
            len(weights),
            sum(t.numel() * t.element_size() for t in weights.values()) / 2**20,
            dtype,
            device,
            len(stored) - len(weights),
        )
        model = self.build_model(
            config,
            weights,
            device,
            max_model_len,
            policy_linear(engine.numeric_policy, device),
        )
        # The model keeps fused copies: dropping the loaded tensors frees the unfused projections
        # before start-up measures what the weights take.
        del weights
        attention = pick_attention(options, device, dtype, pages_for(max_model_len))
        runner, kv_groups = start_paged_model(model, attention, engine, max_model_len, options.progress)
        state = state_pools_of(model)
        scheduler = BatchScheduler(
            runner,
            engine,
            kv_groups,
            config.eos_token_ids,
            max_model_len,
            model_id=f"{self.family}:{path.resolve()}",
            vocab_size=config.vocab_size,
            state_slots=None if state is None else state.running_slots,
            snapshot_slots=0 if state is None else state.snapshot_slots,
        )
        return LoadedModel(
            name=path.name, scheduler=scheduler, tokenizer=tokenizer, max_model_len=max_model_len
        )


def register_paged_line(line: PagedLine[ConfigT]) -> None:
    register_model_types(line.model_types, line.load)
