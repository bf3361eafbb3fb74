"""Tensor parallelism on CPU over gloo (engine.parallel), on the tiny synthetic Qwen3 (4 query heads
over 2 KV heads: split 2 + 2 at TP = 2, each KV head replicated on two ranks at TP = 4), Gemma 3
(the same heads, sliding and global layers, soft-capped logits) and Gemma 4 (the same sliding
layers; global layers with one KV head, replicated on every rank): the same
log-probs as one rank within a bound measured in the same run, the same greedy streams (with
`--decode-fusion` too, at TP = 2), aborts that give their pages back, a worker that dies or hangs
failing its steps with an error instead of a hang, a worker that raises while loading failing
start-up by name, and the refusals (a split that does not divide, a line not sharded, more ranks
than GPUs)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.contract import Failed, Request, SamplingParams, one_line
from engine.parallel.runner import TensorParallelRunner
from engine.parallel.sharding import ShardError
from engine.scheduler import BatchScheduler
from gates.harness.tensor_parallel import max_logprob_delta, reordering_bound
from models.registry import LoadedModel, ModelLoadError, ModelOptions, load_model

# The log-prob bound is measured in each run (gates.harness.tensor_parallel): TP = N may differ
# from TP = 1 by REORDERING_MULTIPLE (4) times TP = 1's own fp32 error against fp64 on the same
# tokens. On this file's 60-token prompt (2026-12-04) that error is 9.5e-7 on all three lines (one
# fp32 ulp of a log-prob between −16 and −8), and TP = 2 and 4 differ from TP = 1 by 9.5e-7: 1×.

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=48, num_kv_pages=96, enable_prefix_caching=False)


def load(
    checkpoint: Path, ranks: int, dtype: str | None = None, device: str = "cpu", **engine: object
) -> LoadedModel:
    config = EngineConfig(**{**ENGINE, "tensor_parallel_size": ranks, "collective_timeout_s": 30.0, **engine})  # type: ignore[arg-type]
    return load_model(str(checkpoint), ModelOptions(engine=config, device=device, dtype=dtype))


def scheduler_of(model: LoadedModel) -> BatchScheduler:
    assert isinstance(model.scheduler, BatchScheduler)
    return model.scheduler


def tp_runner(model: LoadedModel) -> TensorParallelRunner:
    runner = scheduler_of(model).runner
    assert isinstance(runner, TensorParallelRunner)
    return runner


# The key of the one-rank engine in float64, the reference the bound is measured against.
WIDE = 0


def _engines(checkpoint: Path) -> Iterator[dict[int, LoadedModel]]:
    loaded = {ranks: load(checkpoint, ranks) for ranks in (1, 2, 4)}
    loaded[WIDE] = load(checkpoint, 1, dtype="float64")
    yield loaded
    for ranks in (2, 4):
        tp_runner(loaded[ranks]).close()


@pytest.fixture(scope="module")
def engines(tiny_qwen3: Path) -> Iterator[dict[int, LoadedModel]]:
    yield from _engines(tiny_qwen3)


@pytest.fixture(scope="module")
def gemma3_engines(tiny_gemma3: Path) -> Iterator[dict[int, LoadedModel]]:
    yield from _engines(tiny_gemma3)


@pytest.fixture(scope="module")
def gemma4_engines(tiny_gemma4: Path) -> Iterator[dict[int, LoadedModel]]:
    yield from _engines(tiny_gemma4)


LINES = [(line, ranks) for line in ("qwen3", "gemma3", "gemma4") for ranks in (2, 4)]
LINE_IDS = [f"{line}-tp{ranks}" for line, ranks in LINES]


def engines_of(request: pytest.FixtureRequest, line: str) -> dict[int, LoadedModel]:
    loaded: dict[int, LoadedModel] = request.getfixturevalue(
        "engines" if line == "qwen3" else f"{line}_engines"
    )
    return loaded


PROMPTS = [tuple(range(3 + i, 3 + i + n)) for i, n in enumerate((5, 17, 40, 9))]


def greedy(prefix: str, prompts: Sequence[tuple[int, ...]] = PROMPTS, max_tokens: int = 12) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    return [Request(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]


def run(
    scheduler: BatchScheduler, requests: Sequence[Request]
) -> tuple[dict[str, list[int]], dict[str, object]]:
    tokens: dict[str, list[int]] = {}
    terminals: dict[str, object] = {}
    for request in requests:
        scheduler.submit(request)
    steps = 0
    while scheduler.has_work():
        for update in scheduler.step().updates:
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.terminal is not None:
                terminals[update.request_id] = update.terminal
        steps += 1
        assert steps < 1000, "no progress"
    return tokens, terminals


@pytest.mark.parametrize(("line", "ranks"), LINES, ids=LINE_IDS)
def test_teacher_forced_logprobs_match_one_rank(
    request: pytest.FixtureRequest, line: str, ranks: int
) -> None:
    engines = engines_of(request, line)
    tokens = [(7 * i + 3) % 1000 + 1 for i in range(60)]
    pages = [1, 2, 3, 4]
    single, wide = scheduler_of(engines[1]).runner, scheduler_of(engines[WIDE]).runner
    assert hasattr(single, "score") and hasattr(wide, "score")
    reference = single.score(tokens, pages).log_softmax(-1)
    measured = reordering_bound(reference, wide.score(tokens, pages).log_softmax(-1))
    sharded = tp_runner(engines[ranks]).score(tokens, pages).log_softmax(-1)
    assert sharded.shape == reference.shape == (60, 1024)
    # Suppressed ids (Gemma 4's) are -inf on both sides (checked); every other entry is compared.
    delta = max_logprob_delta(sharded, reference)
    print(f"{line} tp={ranks}: max |Δ log-prob| {delta:.3g}; {measured.describe()}")
    assert delta <= measured.bound, (delta, measured)
    assert sharded.argmax(-1).tolist() == reference.argmax(-1).tolist()


@pytest.mark.parametrize(("line", "ranks"), LINES, ids=LINE_IDS)
def test_greedy_streams_match_one_rank(request: pytest.FixtureRequest, line: str, ranks: int) -> None:
    engines = engines_of(request, line)
    # A 48-token step budget cuts the 40-token prompt beside the others: mixed prefill and decode.
    expected, _ = run(scheduler_of(engines[1]), greedy(f"a{ranks}-"))
    got, terminals = run(scheduler_of(engines[ranks]), greedy(f"a{ranks}-"))
    assert got == expected
    assert all(len(t) == 12 for t in got.values()) and not any(
        isinstance(t, Failed) for t in terminals.values()
    )
    assert scheduler_of(engines[ranks]).load().kv_pages_used == 0


def test_abort_gives_the_pages_back_to_every_rank(engines: dict[int, LoadedModel]) -> None:
    """Pages are rank 0's bookkeeping: a page id names the same slot in every rank's pool. An abort
    mid-decode frees them, and the next requests, written over those pages on every rank, still
    give one rank's tokens."""
    scheduler = scheduler_of(engines[2])
    for request in greedy("b", max_tokens=40):
        scheduler.submit(request)
    for _ in range(4):
        scheduler.step()
    used = scheduler.load().kv_pages_used
    assert used > 0
    scheduler.abort("b2")
    assert scheduler.load().kv_pages_used < used
    for request_id in ("b0", "b1", "b3"):
        scheduler.abort(request_id)
    while scheduler.has_work():
        scheduler.step()
    assert scheduler.load().kv_pages_used == 0
    expected, _ = run(scheduler_of(engines[1]), greedy("c"))
    got, _ = run(scheduler, greedy("c"))
    assert got == expected


@pytest.mark.parametrize("line", ("qwen3", "gemma3", "gemma4"))
def test_decode_fusion_at_two_ranks_gives_one_ranks_tokens(
    request: pytest.FixtureRequest, line: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--decode-fusion`` at TP = 2, every rank's decode steps through the fused GEMV (under the
    interpreter): Qwen3's O and down residuals compose around the all-reduce while its norm
    prologues fuse; Gemma's QKV, O, gate/up and down fuse (its row-parallel slices load dense). One
    rank's greedy tokens, log-probs within the bound measured in the run of one unfused rank (4.8e-7
    at all three lines when measured), and rank 0 launched the kernel (the workers are other
    processes: only rank 0 is spied on)."""
    import kernels.triton.fused_gemv as fused_module

    engines = engines_of(request, line)
    expected, expected_logprobs = streams(scheduler_of(engines[1]), greedy("f-"))
    tokens = [(7 * i + 3) % 1000 + 1 for i in range(60)]
    single, wide = scheduler_of(engines[1]).runner, scheduler_of(engines[WIDE]).runner
    assert hasattr(single, "score") and hasattr(wide, "score")
    measured = reordering_bound(
        single.score(tokens, [1, 2, 3, 4]).log_softmax(-1), wide.score(tokens, [1, 2, 3, 4]).log_softmax(-1)
    )
    launched: list[str] = []
    real = fused_module.fused_gemv

    def spied(x: torch.Tensor, weight: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        fusion = args[0] if args else kwargs.get("fusion")
        launched.append(getattr(fusion, "name", "gemv"))
        return real(x, weight, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_module, "fused_gemv", spied)
    config = EngineConfig(**{**ENGINE, "tensor_parallel_size": 2, "collective_timeout_s": 30.0})  # type: ignore[arg-type]
    checkpoint = request.getfixturevalue(f"tiny_{line}")
    model = load_model(str(checkpoint), ModelOptions(engine=config, device="cpu", decode_fusion=True))
    try:
        got, logprobs = streams(scheduler_of(model), greedy("f-"))
    finally:
        tp_runner(model).close()
    assert got == expected
    delta = max(
        abs(a - b) for key in expected for a, b in zip(logprobs[key], expected_logprobs[key], strict=True)
    )
    print(f"{line} tp=2 fused: max |Δ log-prob| {delta:.3g}; {measured.describe()}")
    assert delta <= measured.bound, (delta, measured)
    # Qwen3 fuses its norm prologues (its residuals compose under TP); Gemma its GELU gate/up.
    assert ("norm+gemv" if line == "qwen3" else "gemv+gelu_tanh") in launched, sorted(set(launched))
    assert "gemv+residual" not in launched


def streams(
    scheduler: BatchScheduler, requests: Sequence[Request]
) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Each request's tokens and their log-probs, stepping until the engine is idle."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    for request in requests:
        scheduler.submit(request)
    steps = 0
    while scheduler.has_work():
        for update in scheduler.step().updates:
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            logprobs.setdefault(update.request_id, []).extend(lp.logprob for lp in update.logprobs or ())
        steps += 1
        assert steps < 1000, "no progress"
    return tokens, logprobs


def _step_until_terminal(scheduler: BatchScheduler, request_id: str) -> object:
    """Steps as the driver runs them: a step that raises fails its batch."""
    while scheduler.has_work():
        try:
            outputs = scheduler.step()
        except Exception as exc:
            outputs = scheduler.fail_step(f"step failed: {one_line(exc)}")
        for update in outputs.updates:
            if update.request_id == request_id and update.terminal is not None:
                return update.terminal
    raise AssertionError(f"{request_id} never ended")


def test_a_killed_worker_fails_requests_with_an_error_and_no_hang(tiny_qwen3: Path) -> None:
    model = load(tiny_qwen3, 2)
    scheduler = scheduler_of(model)
    runner = tp_runner(model)
    try:
        run(scheduler, greedy("w", max_tokens=2))
        (pid,) = runner.worker_pids()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        scheduler.submit(greedy("d")[0])
        terminal = _step_until_terminal(scheduler, "d0")
        assert isinstance(terminal, Failed) and "worker rank 1" in terminal.message, terminal
        # Every later request fails the same way, at once: nothing waits on the dead rank.
        scheduler.submit(greedy("e")[0])
        again = _step_until_terminal(scheduler, "e0")
        assert isinstance(again, Failed), again
        assert time.monotonic() - started < 10.0
        assert scheduler.load().kv_pages_used == 0
    finally:
        runner.close()


def test_a_hung_worker_fails_the_step_at_the_collective_timeout(tiny_qwen3: Path) -> None:
    model = load(tiny_qwen3, 2, collective_timeout_s=2.0)
    scheduler = scheduler_of(model)
    runner = tp_runner(model)
    (pid,) = runner.worker_pids()
    assert pid is not None
    try:
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        scheduler.submit(greedy("h")[0])
        terminal = _step_until_terminal(scheduler, "h0")
        waited = time.monotonic() - started
        assert isinstance(terminal, Failed) and "rank 0" in terminal.message, terminal
        assert 1.5 < waited < 10.0, waited
        # Out of step after a failed collective: the workers are stopped, not left behind.
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        runner.close()


def test_splits_that_do_not_divide_are_refused_before_any_worker_starts(tiny_qwen3: Path) -> None:
    for ranks in (3, 8):
        with pytest.raises(ShardError) as caught:
            load(tiny_qwen3, ranks)
        assert (caught.value.field, caught.value.value) == ("num_attention_heads", 4)


def test_a_line_without_a_sharded_runtime_is_refused_by_name(tiny_qwen3: Path) -> None:
    from dataclasses import replace

    from models.qwen3 import QWEN3

    unsharded = replace(QWEN3, sharded=None)
    options = ModelOptions(engine=EngineConfig(tensor_parallel_size=2), device="cpu")
    with pytest.raises(ModelLoadError, match="qwen3 line does not run sharded"):
        unsharded.load(str(tiny_qwen3), options)


def test_a_worker_that_raises_while_loading_fails_start_up_by_rank_and_cause(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At TP = 4, rank 2's slice reads fail: start-up fails with one line naming rank 2 and the
    read's error, the other workers are stopped, and nothing waits for a group that cannot form."""
    from rank_faults import FAILING_RANK_ENV, PIDS_ENV, start_rank_failing_slice_read

    import models.paged_line

    monkeypatch.setattr(models.paged_line, "_start_rank", start_rank_failing_slice_read)
    monkeypatch.setenv(FAILING_RANK_ENV, "2")
    monkeypatch.setenv(PIDS_ENV, str(tmp_path))
    started = time.monotonic()
    with pytest.raises(ModelLoadError) as caught:
        load(tiny_qwen3, 4)
    waited = time.monotonic() - started
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith(
        "--tensor-parallel-size 4: start-up failed: tensor-parallel worker rank 2 exited"
    ), message
    assert "while starting: OSError: slice" in message and "could not be read (injected)" in message, message
    # The worker's traceback is in rank 0's log, not in the error.
    logged = [r.getMessage() for r in caplog.records if r.name == "infer.parallel"]
    assert any("rank 2 failed" in m and "Traceback" in m and "_unreadable" in m for m in logged), logged
    # Spawning three interpreters takes seconds on a shared CPU; the join timeout is 900 s.
    assert waited < 120.0, waited
    pids = {path.name: int(path.read_text()) for path in tmp_path.iterdir()}
    assert set(pids) == {"rank1", "rank2", "rank3"}
    # Every worker is gone: the failed one, and the two that waited for it to join.
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_that_raises_in_a_step_fails_the_requests_with_one_line_and_no_hang(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's forward raises: the step fails its batch with one line naming the rank, what it
    was doing and the cause, at once, and so does every later request (the engine is stopped)."""
    from rank_faults import FAILING_RANK_ENV, start_rank_failing_forward

    import models.paged_line

    monkeypatch.setattr(models.paged_line, "_start_rank", start_rank_failing_forward)
    monkeypatch.setenv(FAILING_RANK_ENV, "1")
    model = load(tiny_qwen3, 2)
    scheduler = scheduler_of(model)
    runner = tp_runner(model)
    try:
        started = time.monotonic()
        scheduler.submit(greedy("f")[0])
        terminal = _step_until_terminal(scheduler, "f0")
        assert isinstance(terminal, Failed), terminal
        assert "\n" not in terminal.message, terminal.message
        assert (
            "worker rank 1 exited with code 1: while serving steps: RuntimeError: forward failed (injected)"
            in (terminal.message)
        ), terminal.message
        scheduler.submit(greedy("g")[0])
        assert isinstance(_step_until_terminal(scheduler, "g0"), Failed)
        assert time.monotonic() - started < 10.0
        assert scheduler.load().kv_pages_used == 0
    finally:
        runner.close()


def test_more_ranks_than_visible_gpus_are_refused_naming_both(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA each rank needs a GPU of its own (the count is faked: this machine has none). The
    refusal comes before any worker starts; with enough GPUs the pool is asked for CUDA ranks."""
    import models.paged_line

    class PoolAsked(Exception):
        pass

    asked: list[tuple[int, str]] = []

    def pool(size: int, build: object, timeout_s: float, device_type: str) -> None:
        asked.append((size, device_type))
        raise PoolAsked

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(models.paged_line, "WorkerPool", pool)
    with pytest.raises(
        ModelLoadError, match="--tensor-parallel-size 2: each rank needs a GPU of its own and 1 is visible"
    ):
        load(tiny_qwen3, 2, device="cuda")
    with pytest.raises(
        ModelLoadError, match="rank r runs on cuda:r; choose the GPUs with CUDA_VISIBLE_DEVICES"
    ):
        load(tiny_qwen3, 2, device="cuda:1")
    assert asked == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(PoolAsked):
        load(tiny_qwen3, 2, device="cuda")
    assert asked == [(2, "cuda")]


def test_gpu_ranks_form_an_nccl_group_or_refuse_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank r's device is cuda:r and its group NCCL; a torch build without NCCL (faked here, so the
    test reads the same on any build) refuses by name when the group forms."""
    import torch.distributed as dist

    from engine.parallel.group import BackendUnavailableError, ProcessRankGroup, rank_device

    assert rank_device("cuda", 1) == torch.device("cuda", 1) and rank_device("cpu", 1) is None
    group = ProcessRankGroup(dist.HashStore(), 0, 1, 5.0, device=rank_device("cuda", 0))
    assert group.backend == "nccl" and group.device == torch.device("cuda", 0)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="has no NCCL"):
        group.min_over_ranks([1])


def test_float64_is_a_cpu_reference_only(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound's fp64 reference runs on the CPU; asked of a GPU (faked here) it is refused by name."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(
        ModelLoadError, match="--dtype float64 on cuda: float64 is the CPU reference dtype only"
    ):
        load(tiny_qwen3, 1, dtype="float64", device="cuda")


def test_a_gpu_group_never_blocks_the_host_on_a_collective() -> None:
    """On NCCL a wait orders the stream after the collective (capturable, no host sync: the watchdog
    holds the timeout); on gloo the host waits, bounded by the group's timeout."""
    import torch.distributed as dist

    from engine.parallel.group import ProcessRankGroup, rank_device

    class Work:
        def __init__(self) -> None:
            self.waits: list[tuple[object, ...]] = []

        def wait(self, *timeout: object) -> bool:
            self.waits.append(timeout)
            return True

    gpu = ProcessRankGroup(dist.HashStore(), 0, 2, 5.0, device=rank_device("cuda", 0))
    cpu = ProcessRankGroup(dist.HashStore(), 0, 2, 5.0)
    for group, expected in ((gpu, ()), (cpu, (cpu.timeout,))):
        work = Work()
        group._wait(work, "all-reduce")  # type: ignore[arg-type]
        assert work.waits == [expected], (group.backend, work.waits)


def test_a_worker_killed_after_the_check_is_named_by_its_exit_not_the_broken_pipe() -> None:
    """The kill lands between the pre-send check and the send: the send's broken pipe must still
    read as the worker's exit (the HTTP test's one-line message depends on it)."""
    from engine.parallel.runner import StepChannel, StopMessage
    from engine.parallel.workers import WorkerDiedError

    class BrokenPipe:
        def send_bytes(self, payload: bytes) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    class DiesDuringGrace:
        def check(self, grace_s: float = 0.0) -> None:
            if grace_s > 0.0:  # the exit is seen only once the check waits for it
                raise WorkerDiedError(1, -9)

        def stop(self) -> None: ...

        def kill(self) -> None: ...

        def pids(self) -> list[int | None]:
            return [None]

    runner = TensorParallelRunner(None, StepChannel([BrokenPipe()]), DiesDuringGrace())  # type: ignore[arg-type,list-item]
    with pytest.raises(WorkerDiedError, match="rank 1 exited with code -9"):
        runner._announce(StopMessage())
