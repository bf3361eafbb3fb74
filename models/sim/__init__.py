"""`sim`: a real scheduler, paged KV and prefix cache over a fake, deterministic model.

Public surface (kept stable; the HTTP frontend and tests build on it): `build_sim`, `SimOptions`,
`sim_completion` / `SimCompletion`, `SimTokenizer`, `SimRunner`.
"""

from models.registry import register_name
from models.sim.line import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_NUM_KV_PAGES,
    SIM_MODEL_NAME,
    SimOptions,
    build_sim,
    load_sim,
    sim_options,
)
from models.sim.rule import SimCompletion, sim_completion
from models.sim.runner import FaultHook, SimKVError, SimRunner
from models.sim.tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    TURN_END_TOKEN_ID,
    TURN_START_TOKEN_ID,
    VOCAB_SIZE,
    SimTokenizer,
)

register_name(SIM_MODEL_NAME, load_sim)

__all__ = [
    "BOS_TOKEN_ID",
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_NUM_KV_PAGES",
    "EOS_TOKEN_ID",
    "SIM_MODEL_NAME",
    "TURN_END_TOKEN_ID",
    "TURN_START_TOKEN_ID",
    "VOCAB_SIZE",
    "FaultHook",
    "SimCompletion",
    "SimKVError",
    "SimOptions",
    "SimRunner",
    "SimTokenizer",
    "build_sim",
    "load_sim",
    "sim_completion",
    "sim_options",
]
