"""One builder for every paged model line: a line states its facts in a `PagedLine`, and `load`
turns a checkpoint directory into a served `LoadedModel` the same way for all of them.

In order, before any weight is read: the config (fail-closed), device, dtype, tokenizer and context
ceiling; then every tensor is checked and loaded; then the model is built, start-up sizes its KV
groups on the device (engine.paged_startup) and the scheduler gets the groups start-up sized.

At `--tensor-parallel-size N` > 1 the split is checked first (`check_split`: the line runs
sharded, the device has a GPU per rank, the config's `shard_plan` divides, each refused by name),
then the engine's worker pool starts ranks 1..N-1, each running `_start_rank` (this same path over
its own slices of the weights; on CUDA rank r on `cuda:r`), while rank 0 does the same here and
hands the scheduler a `TensorParallelRunner`. docs/tensor-parallel.md.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import torch

from engine.contract import EngineFatalError
from engine.forward_batch import PagedCausalLM
from engine.kv.spec import KVGroupSpec
from engine.kv.state_pool import state_pools_of
from engine.model_runner import PagedModelRunner
from engine.paged_startup import start_paged_model
from engine.parallel.group import SINGLE_RANK, RankGroup, rank_device
from engine.parallel.runner import TensorParallelRunner
from engine.parallel.sharding import ShardPlan
from engine.parallel.workers import WorkerPool
from engine.progress import SILENT
from engine.runner import ModelRunner
from engine.scheduler import BatchScheduler
from kernels.gemm.dispatch import Linear, policy_linear
from kernels.gemm.projections import policy_projections
from kernels.kv_layout import pages_for
from models.checkpoint import StoredTensor, TensorPart, TensorSpec, load_checked, stored_tensors
from models.context_limit import resolve_max_model_len
from models.device_choice import pick_attention, pick_device, pick_dtype
from models.hf_tokenizer import HFTokenizer
from models.registry import LoadedModel, ModelLoadError, ModelOptions, register_model_types

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


class ShardedModelFactory(Protocol[ConfigIn]):
    def __call__(
        self,
        config: ConfigIn,
        weights: Mapping[str, torch.Tensor],
        device: torch.device,
        max_positions: int,
        linear: Linear,
        *,
        plan: ShardPlan,
        group: RankGroup,
    ) -> PagedCausalLM: ...


@dataclass(frozen=True, slots=True)
class ShardedRuntime(Generic[ConfigT]):
    """What a line that runs under tensor parallelism adds: the part of each split tensor a rank
    reads, and the model built over those slices and the rank's group."""

    slices: Callable[[ConfigT, ShardPlan, int, Mapping[str, StoredTensor]], Mapping[str, TensorPart]]
    build_model: ShardedModelFactory[ConfigT]


@dataclass(frozen=True, slots=True)
class PagedLine(Generic[ConfigT]):
    """A model line's facts: the model types it serves, how to parse and check a checkpoint of
    them, and the model class. `context_field` names the context ceiling in a refusal.
    `shard_plan` says how a config splits over N ranks; `sharded`, for a line whose forward runs
    split, how to load and build one rank."""

    family: str
    model_types: tuple[str, ...]
    parse_config: Callable[[Path], ConfigT]
    context_field: str
    weight_map: Callable[[ConfigT, Mapping[str, StoredTensor]], WeightMap]
    build_model: ModelFactory[ConfigT]
    shard_plan: Callable[[ConfigT, int], ShardPlan]
    sharded: ShardedRuntime[ConfigT] | None = None

    def load(self, spec: str, options: ModelOptions) -> LoadedModel:
        path = Path(spec)
        config = self.parse_config(path)
        engine = options.engine
        ranks = engine.tensor_parallel_size
        plan = self._plan(config, options, ranks) if ranks > 1 else None
        if plan is not None and pick_device(options).type == "cuda":
            options = replace(options, device=str(rank_device("cuda", 0)))
        tokenizer = HFTokenizer(path)
        runner: ModelRunner
        if plan is None:
            local, kv_groups, max_model_len = self._start(path, config, options, None, SINGLE_RANK)
            runner = local
        else:
            # Workers get what they load with, not where rank 0 reports progress.
            build = functools.partial(_start_rank, self, spec, replace(options, progress=SILENT))
            pool = WorkerPool(ranks, build, engine.collective_timeout_s, pick_device(options).type)
            try:
                local, kv_groups, max_model_len = self._start(path, config, options, plan, pool.group())
            except EngineFatalError as exc:
                # A rank that raised or died while loading, or a group that never formed: a
                # start-up error naming the rank and the cause (its traceback is in the log).
                pool.kill()
                raise ModelLoadError(f"--tensor-parallel-size {ranks}: start-up failed: {exc}") from exc
            except BaseException:
                pool.kill()
                raise
            runner = TensorParallelRunner(local, pool.channel, pool)
        state = state_pools_of(local.model)
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

    def check_split(self, spec: str, options: ModelOptions) -> None:
        """Refuse `options`' tensor-parallel size for this checkpoint as `load` would, reading only
        its config: what a command checks before it loads anything."""
        ranks = options.engine.tensor_parallel_size
        if ranks > 1:
            self._plan(self.parse_config(Path(spec)), options, ranks)

    def _plan(self, config: ConfigT, options: ModelOptions, ranks: int) -> ShardPlan:
        """The split at `ranks`, refused before any weight is read or process started: by the line
        (not sharded yet), by the device (a GPU per rank), or by the config field that does not
        divide."""
        if self.sharded is None:
            raise ModelLoadError(
                f"--tensor-parallel-size {ranks}: the {self.family} line does not run sharded yet "
                "(docs/tensor-parallel.md lists the lines that do)"
            )
        check_rank_devices(pick_device(options), ranks)
        return self.shard_plan(config, ranks)

    def _start(
        self, path: Path, config: ConfigT, options: ModelOptions, plan: ShardPlan | None, group: RankGroup
    ) -> tuple[PagedModelRunner, tuple[KVGroupSpec, ...], int]:
        """Load this rank's weights (all of them at one rank), build the model and start it up."""
        device = pick_device(options)
        dtype = pick_dtype(options, device)
        engine = options.engine
        max_model_len = resolve_max_model_len(
            engine.max_model_len,
            config.max_position_embeddings,
            self.context_field,
            engine.allow_long_max_model_len,
        )
        stored = stored_tensors(path)
        wanted = self.weight_map(config, stored)
        slices = None
        if plan is not None:
            assert self.sharded is not None
            slices = self.sharded.slices(config, plan, group.rank, stored)
        weights = load_checked(
            path,
            wanted.expected,
            stored,
            device,
            dtype,
            ignore=wanted.skip,
            progress=options.progress,
            slices=slices,
        )
        log.info(
            "%s: %d tensors resident (%.1f MiB, %s on %s; rank %d of %d), %d stored tensors skipped",
            path.name,
            len(weights),
            sum(t.numel() * t.element_size() for t in weights.values()) / 2**20,
            dtype,
            device,
            group.rank,
            group.size,
            len(stored) - len(weights),
        )
        linear: Linear = policy_linear(engine.numeric_policy, device)
        if options.decode_fusion:  # a line that knows the seam fuses its decode steps; others call it
            linear = policy_projections(engine.numeric_policy, device, linear, decode_fusion=True)
        if plan is None:
            model = self.build_model(config, weights, device, max_model_len, linear)
        else:
            assert self.sharded is not None
            model = self.sharded.build_model(
                config, weights, device, max_model_len, linear, plan=plan, group=group
            )
        # The model keeps fused copies: dropping the loaded tensors frees the unfused projections
        # before start-up measures what the weights take.
        del weights
        attention = pick_attention(options, device, dtype, pages_for(max_model_len))
        runner, kv_groups = start_paged_model(
            model, attention, engine, max_model_len, options.progress, group
        )
        return runner, kv_groups, max_model_len


def check_rank_devices(device: torch.device, ranks: int) -> None:
    """`ranks` > 1 ranks on `device`: processes on the CPU (gloo), or one visible GPU each (NCCL,
    rank r on `cuda:r`: pick the GPUs with CUDA_VISIBLE_DEVICES). Anything else is refused by name."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ModelLoadError(
            f"--tensor-parallel-size {ranks} on {device}: tensor parallelism runs on the CPU (gloo) or "
            "on CUDA GPUs (NCCL)"
        )
    if device.index not in (None, 0):
        raise ModelLoadError(
            f"--tensor-parallel-size {ranks} with --device {device}: rank r runs on cuda:r; choose the "
            "GPUs with CUDA_VISIBLE_DEVICES instead"
        )
    visible = torch.cuda.device_count()
    if ranks > visible:
        raise ModelLoadError(
            f"--tensor-parallel-size {ranks}: each rank needs a GPU of its own and {visible} "
            f"{'is' if visible == 1 else 'are'} visible"
        )
    log.warning(
        "tensor parallelism over NCCL (%d ranks on cuda:0..%d) has not run on GPUs before, nor have "
        "decode graphs holding its collectives (--enforce-eager runs without them; docs/tensor-parallel.md)",
        ranks,
        ranks - 1,
    )


def _start_rank(
    line: PagedLine[ConfigT], spec: str, options: ModelOptions, group: RankGroup
) -> PagedModelRunner:
    """A worker rank's runner (engine.parallel.workers runs it in the worker process), on the
    device its group names (its own GPU) when it names one."""
    if group.device is not None:
        # Its GPU is also the current device: what allocates on "the" CUDA device lands there.
        torch.cuda.set_device(group.device)
        options = replace(options, device=str(group.device))
    path = Path(spec)
    config = line.parse_config(path)
    plan = line.shard_plan(config, group.size)
    runner, _, _ = line._start(path, config, options, plan, group)
    return runner


def register_paged_line(line: PagedLine[ConfigT]) -> None:
    register_model_types(line.model_types, line.load, line.check_split)
