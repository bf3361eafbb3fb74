"""Loading a checkpoint through infer's own path and driving its scheduler synchronously.

Every engine a gate builds runs at the tensor-parallel size the run was given (`infer gates
--tensor-parallel-size N`, which the runner passes as INFER_GATE_TENSOR_PARALLEL_SIZE) and with its
decode-path knobs (`--decode-fusion` and the others of DECODE_PATH_KNOBS, passed as
INFER_GATE_DECODE_PATH), unless the gate asks for a value of that knob itself."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.contract import Admission, Request, SamplingParams, Terminal, TokenLogprob
from engine.model_runner import PagedModelRunner
from engine.parallel.runner import TensorParallelRunner
from engine.scheduler import BatchScheduler
from gates.runner.needs import DECODE_PATH_ENV, DECODE_PATH_KNOBS, TENSOR_PARALLEL_ENV
from kernels.kv_layout import pages_for
from models.checkpoint import WeightCache, reusing_weights
from models.registry import LoadedModel, ModelOptions, load_model

GATE_KV_PAGES_GPU = 2048
GATE_KV_PAGES_CPU = 512
# On a GPU, gates capture decode graphs up to this many rows unless they ask for more: buckets
# 1, 2, 4, 8, 16 keep start-up to seconds on a 12B model, and graphs are still what decode runs.
GATE_MAX_NUM_SEQS_GPU = 16
# One read of the checkpoint per gate process, however many engines the gate builds over it.
_WEIGHTS = WeightCache()


class _PrintedProgress:
    """Start-up's notes and each finished task as plain lines: a gate's output tail then says what
    loading took and how start-up sized the KV pools."""

    def __init__(self) -> None:
        self._label = ""
        self._started = 0.0

    def start(self, label: str, total: float) -> None:
        self._label, self._started = label, time.monotonic()

    def advance(self, detail: str = "", amount: float = 1) -> None:
        pass

    def finish(self) -> None:
        print(f"{self._label}: {time.monotonic() - self._started:.1f} s")

    def note(self, message: str) -> None:
        print(message)


def gate_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gate_tensor_parallel_size() -> int:
    """The ranks the run asks every gate's engines to run at (1 when it asks nothing)."""
    raw = os.environ.get(TENSOR_PARALLEL_ENV, "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{TENSOR_PARALLEL_ENV}={raw!r}: expected a whole number of ranks ≥ 1")
    return int(raw)


def gate_decode_path() -> dict[str, object]:
    """The decode-path knobs the run asks every gate's engines to use, by name (none: the defaults)."""
    raw = os.environ.get(DECODE_PATH_ENV, "").strip()
    knobs = json.loads(raw) if raw else {}
    if not isinstance(knobs, dict) or set(knobs) - set(DECODE_PATH_KNOBS):
        raise ValueError(
            f"{DECODE_PATH_ENV}={raw!r}: expected a JSON object over {', '.join(DECODE_PATH_KNOBS)}"
        )
    return knobs


_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def load_for_gate(checkpoint: Path, *, dtype: str | None = None, **engine: object) -> LoadedModel:
    """The model as `infer serve` would load it on this machine (bf16 + FlashInfer + CUDA graphs on a
    GPU, fp32 + torch attention on CPU; `dtype` overrides the dtype), with engine settings
    overridden by keyword, at the run's tensor-parallel size unless they name one. The KV pool
    has a fixed size (gates load several models side by side, so none may take the device), and
    the weights are shared with every other engine this process built over the checkpoint."""
    on_gpu = gate_device().type == "cuda"
    engine.setdefault("num_kv_pages", GATE_KV_PAGES_GPU if on_gpu else GATE_KV_PAGES_CPU)
    engine.setdefault("tensor_parallel_size", gate_tensor_parallel_size())
    if on_gpu:
        engine.setdefault("max_num_seqs", GATE_MAX_NUM_SEQS_GPU)
    model_knobs: dict[str, object] = {}
    for name, value in gate_decode_path().items():
        if name not in _ENGINE_FIELDS:
            model_knobs[name] = value
        # A gate that overlaps prefill asks for the one overlap EngineConfig allows at a time.
        elif not (name == "async_scheduling" and engine.get("async_prefill")):
            engine.setdefault(name, value)
    config = EngineConfig(**engine)  # type: ignore[arg-type]
    # Another dtype than the serving one is a one-off (a wider reference): not kept in the cache.
    with reusing_weights(_WEIGHTS) if dtype is None else contextlib.nullcontext():
        return load_model(
            str(checkpoint),
            ModelOptions(
                engine=config,
                device=str(gate_device()),
                dtype=dtype,
                progress=_PrintedProgress(),
                **model_knobs,  # type: ignore[arg-type]
            ),
        )


def close_engine(model: LoadedModel) -> None:
    """Stop a sharded engine's worker processes now (a one-rank engine holds none)."""
    runner = batch_scheduler(model).runner
    if isinstance(runner, TensorParallelRunner):
        runner.close()


def batch_scheduler(model: LoadedModel) -> BatchScheduler:
    if not isinstance(model.scheduler, BatchScheduler):
        raise TypeError(f"expected a BatchScheduler, got {type(model.scheduler).__name__}")
    return model.scheduler


def paged_runner(model: LoadedModel) -> PagedModelRunner:
    """The engine's paged runner; of a sharded engine, rank 0's (its model, its graphs: to read,
    never to run a step on alone, which would leave the other ranks waiting)."""
    runner = batch_scheduler(model).runner
    if isinstance(runner, TensorParallelRunner):
        return runner.local
    if not isinstance(runner, PagedModelRunner):
        raise TypeError(f"expected a PagedModelRunner, got {type(runner).__name__}")
    return runner


@dataclass(slots=True)
class Completion:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    admission: Admission | None = None
    cached_tokens: int | None = None
    terminal: Terminal | None = None
    terminals_seen: int = 0


def drive(
    model: LoadedModel,
    requests: Sequence[Request],
    arrivals: Mapping[int, Sequence[Request]] | None = None,
    after_step: Callable[[int, dict[str, Completion]], None] | None = None,
    max_steps: int = 100_000,
) -> dict[str, Completion]:
    """Submit `requests`, then step until idle; `arrivals[k]` are submitted before step k.
    Collects every update and checks that each request sees at most one terminal."""
    scheduler = model.scheduler
    results: dict[str, Completion] = {}

    def submit(batch: Iterable[Request]) -> None:
        for request in batch:
            results[request.request_id] = Completion()
            scheduler.submit(request)

    submit(requests)
    pending = dict(arrivals or {})
    step = 0
    while scheduler.has_work() or any(k >= step for k in pending):
        submit(pending.pop(step, ()))
        if scheduler.has_work():
            for update in scheduler.step().updates:
                done = results[update.request_id]
                done.tokens.extend(update.new_token_ids)
                done.logprobs.extend(update.logprobs or ())
                if update.admission is not None:
                    assert done.admission is None, f"{update.request_id}: admission reported twice"
                    done.admission = update.admission
                if update.cached_tokens is not None:
                    done.cached_tokens = update.cached_tokens
                if update.terminal is not None:
                    done.terminals_seen += 1
                    done.terminal = update.terminal
        if after_step is not None:
            after_step(step, results)
        step += 1
        if step > max_steps:
            raise AssertionError(f"the scheduler did not finish within {max_steps} steps")
    return results


def greedy(max_tokens: int, logprobs: int | None = 5) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def random_prompt(length: int, seed: int, vocab_size: int, avoid: Iterable[int] = ()) -> tuple[int, ...]:
    """Token ids drawn from the vocabulary (special ids in `avoid` excluded), deterministic per seed."""
    generator = torch.Generator().manual_seed(seed)
    banned = set(avoid)
    ids: list[int] = []
    while len(ids) < length:
        for t in torch.randint(0, vocab_size, (length,), generator=generator).tolist():
            if t not in banned and len(ids) < length:
                ids.append(t)
    return tuple(ids)


def _fresh_logits(model: LoadedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """infer's float32 logits at every position of `token_ids`, from one prefill on a model that has
    served nothing yet (the pages used are 1..n/16, which nothing else holds); on every rank of a
    sharded engine, the logits rank 0's."""
    pages = list(range(1, 1 + pages_for(len(token_ids))))
    runner = batch_scheduler(model).runner
    if not isinstance(runner, PagedModelRunner | TensorParallelRunner):
        raise TypeError(f"expected a paged or tensor-parallel runner, got {type(runner).__name__}")
    return runner.score(token_ids, pages)


def top_logit(model: LoadedModel, length: int = 64) -> float:
    """The largest finite |logit| a fresh model produces over a random prompt's positions: what
    sets the bf16 step its log-probs move by (tolerances.for_logits). The prompt's ids (16..999)
    are in every vocabulary here and past the low special ids."""
    logits = _fresh_logits(model, random_prompt(length, seed=7, vocab_size=1000, avoid=range(16)))
    return float(logits[torch.isfinite(logits)].abs().max())


def score(model: LoadedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """infer's float32 log-probs at every position of `token_ids` ([n, vocab], on the host, as
    `hf_logprobs` gives them), on a model that has served nothing yet (`_fresh_logits`)."""
    return torch.log_softmax(_fresh_logits(model, token_ids), dim=-1).cpu()
