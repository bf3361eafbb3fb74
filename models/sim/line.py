"""The sim model line: options, `build_sim`, and the registry loader for `--model sim`."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.contract import ContractError
from engine.kv import KVGroupSpec
from engine.scheduler import BatchScheduler
from models.registry import LoadedModel, ModelOptions
from models.sim.runner import FaultHook, SimRunner
from models.sim.tokenizer import VOCAB_SIZE, SimTokenizer

SIM_MODEL_NAME = "sim"
# 256 concurrent chats of a few hundred tokens each, plus room for the prefix cache.
DEFAULT_NUM_KV_PAGES = 16384
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True, slots=True)
class SimOptions:
    """How to build a sim. `num_kv_pages` counts the padding page. `sliding_window` adds a
    second KV group with that window beside the full one (window release and the sliding prefix
    cache then run as they do for Gemma 4). The engine config's own `num_kv_pages` and
    `max_model_len` are not read here: `sim_options` maps them."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    step_delay_s: float = 0.0
    num_kv_pages: int = DEFAULT_NUM_KV_PAGES
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    sliding_window: int | None = None
    model_id: str = SIM_MODEL_NAME

    def __post_init__(self) -> None:
        if self.step_delay_s < 0:
            raise ContractError("step_delay_s", self.step_delay_s, "must be >= 0")
        if self.max_model_len < 1:
            raise ContractError("max_model_len", self.max_model_len, "must be at least 1")

    def kv_groups(self) -> tuple[KVGroupSpec, ...]:
        groups = [KVGroupSpec("full", self.num_kv_pages)]
        if self.sliding_window is not None:
            groups.append(KVGroupSpec("sliding", self.num_kv_pages, self.sliding_window))
        return tuple(groups)


def build_sim(options: SimOptions | None = None, fault: FaultHook | None = None) -> LoadedModel:
    """A sim engine: a `BatchScheduler` over a `SimRunner`. `fault` is called with each step's
    batch before the step runs; raising from it makes that step fail."""
    options = options or SimOptions()
    groups = options.kv_groups()
    tokenizer = SimTokenizer()
    runner = SimRunner(groups, options.step_delay_s, fault)
    scheduler = BatchScheduler(
        runner,
        options.engine,
        groups,
        tokenizer.eos_token_ids,
        options.max_model_len,
        model_id=options.model_id,
        vocab_size=VOCAB_SIZE,
    )
    return LoadedModel(SIM_MODEL_NAME, scheduler, tokenizer, options.max_model_len)


def sim_options(model: ModelOptions) -> SimOptions:
    """`--model sim`'s options from the CLI-level `ModelOptions`."""
    engine = model.engine
    return SimOptions(
        engine=engine,
        step_delay_s=model.sim_step_delay_s,
        num_kv_pages=engine.num_kv_pages if engine.num_kv_pages is not None else DEFAULT_NUM_KV_PAGES,
        max_model_len=engine.max_model_len if engine.max_model_len is not None else DEFAULT_MAX_MODEL_LEN,
    )


def load_sim(name: str, options: ModelOptions) -> LoadedModel:
    return build_sim(sim_options(options))
