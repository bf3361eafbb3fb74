"""The step contract: the value objects a model line and the engine exchange.

A model line hands the engine a `Scheduler`; the engine owns the loop and the model owns its step.
Everything here is a frozen value object except the `Scheduler` protocol itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable


class ContractError(ValueError):
    """A value that breaks the contract; carries the offending field and value."""

    def __init__(self, field_name: str, value: object, why: str) -> None:
        super().__init__(f"{field_name}={value!r}: {why}")
        self.field_name = field_name
        self.value = value
        self.why = why


class EngineFatalError(RuntimeError):
    """An error after which no step can succeed (a rank of the engine is gone or out of step): the
    driver fails the step's batch, then every open request, and turns unhealthy."""


def one_line(exc: BaseException) -> str:
    """`Type: the message's first line`: what a failed request, /health or a one-line log may
    carry of an error (a traceback goes to the server's log only)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class FinishReason(StrEnum):
    LENGTH = "length"
    STOP = "stop"


class RejectReason(StrEnum):
    CONTEXT_LENGTH = "context_length"
    KV_BUDGET = "kv_budget"
    INVALID_INPUT = "invalid_input"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples. `top_k=0` and `top_p=1.0` and `min_p=0.0` switch those filters off;
    `temperature=0.0` is greedy. `logprobs=None` returns none; `logprobs=k` returns the chosen
    token's log-prob plus the top k alternatives (k may be 0)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ContractError("max_tokens", self.max_tokens, "must be at least 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ContractError("temperature", self.temperature, "must be a finite number >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise ContractError("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            raise ContractError("top_k", self.top_k, "must be >= 0 (0 disables it)")
        if not (0.0 <= self.min_p <= 1.0):
            raise ContractError("min_p", self.min_p, "must be in [0, 1]")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ContractError("logprobs", self.logprobs, "must be between 0 and 20")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ContractError("request_id", self.request_id, "must be a non-empty string")
        if not self.prompt_token_ids:
            raise ContractError("prompt_token_ids", self.prompt_token_ids, "must hold at least one token")


# Terminals: every request that is admitted or rejected ends with exactly one of these, unless it
# is aborted, in which case it retires silently.


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: RejectReason
    message: str


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


Terminal = Finished | Rejected | Failed


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Admission:
    queued_time: float
    scheduled_time: float
    prompt_tokens: int


@dataclass(slots=True)
class RequestUpdate:
    """Everything one step says about one request. At most one per request per step."""

    request_id: str
    admission: Admission | None = None
    new_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    cached_tokens: int | None = None
    terminal: Terminal | None = None


@dataclass(frozen=True, slots=True)
class StepOutputs:
    updates: tuple[RequestUpdate, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.updates)


@dataclass(frozen=True, slots=True)
class GroupLoad:
    name: str
    pages_used: int
    pages_total: int


@dataclass(frozen=True, slots=True)
class Load:
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    groups: tuple[GroupLoad, ...] = ()
    # Per-request state slots (recurrent models; engine/kv/state_pool.py): taken and allocatable.
    state_slots_used: int = 0
    state_slots_total: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0


@runtime_checkable
class Scheduler(Protocol):
    """What every model line speaks. All methods run on one thread: the driver's."""

    def submit(self, request: Request) -> None:
        """Park a request. Admission happens inside a step, never here."""

    def abort(self, request_id: str) -> None:
        """Retire a request silently: no terminal, pages freed now, later updates dropped."""

    def step(self) -> StepOutputs:
        """Run one model step; at most one update per request."""
        ...

    def fail_step(self, message: str) -> StepOutputs:
        """Called after `step` raised: fail the requests of that step's batch, free their pages,
        and leave the scheduler able to serve the rest."""
        ...

    def load(self) -> Load: ...

    def has_work(self) -> bool: ...
