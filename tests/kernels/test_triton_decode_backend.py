"""The `triton` attention backend (kernels/attention/triton_decode_backend.py): decode steps through
the split-KV kernel, prefill steps through the inner backend, graph buckets planned into buffers
that never move, and a whole tiny Qwen3 decoding the torch backend's tokens with it.
Interpreter on a CPU, the GPU when one is present."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from engine.scheduler import BatchScheduler
from kernels.attention import triton_decode_backend
from kernels.attention.base import AttentionLayerSpec, GroupBatch
from kernels.attention.torch_backend import TorchAttention
from kernels.attention.triton_decode_backend import KERNEL_ROWS, TritonDecodeAttention
from kernels.gemm.names import POLICY_NAMES, is_end_to_end_invariant
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE
from kernels.triton.decode_attention import decode_attention
from models.registry import ModelOptions, load_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYER = AttentionLayerSpec(8, 2, 128, 128**-0.5)
POOL_PAGES = 24


def _backend(max_rows: int = 8, kernel_rows: int | None = None) -> TritonDecodeAttention:
    return TritonDecodeAttention(
        TorchAttention(),
        DEVICE,
        torch.bfloat16,
        max_pages_per_seq=8,
        max_rows=max_rows,
        kernel_rows=kernel_rows,
    )


def _pool_and_q(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(POOL_PAGES, 2, PAGE_SIZE, 2, 128, generator=g).to(torch.bfloat16).to(DEVICE)
    q = torch.randn(rows, 8, 128, generator=g).to(torch.bfloat16).to(DEVICE)
    return pool, q


DECODE = GroupBatch((1, 1, 1), (17, 70, 3), ((5, 9), (1, 2, 3, 4, 6), (7,)), PAGE_SIZE)


def test_decode_steps_run_the_kernel_and_prefill_steps_the_inner_backend() -> None:
    backend = _backend()
    pool, q = _pool_and_q(3)
    backend.plan(0, DECODE, LAYER)
    got = backend.run(0, LAYER, q, pool)
    table = torch.tensor(
        [[5, 9, 0, 0, 0], [1, 2, 3, 4, 6], [7, 0, 0, 0, 0]], dtype=torch.int32, device=DEVICE
    )
    lens = torch.tensor(DECODE.kv_lens, dtype=torch.int32, device=DEVICE)
    assert torch.equal(got, decode_attention(q, pool, table, lens, LAYER))
    assert (backend.decode_plans, backend.inner_plans) == (1, 0)

    mixed = GroupBatch((1, 4), (17, 20), ((5, 9), (1, 2)), PAGE_SIZE)
    _, q5 = _pool_and_q(5, seed=1)
    backend.plan(0, mixed, LAYER)
    reference = TorchAttention()
    reference.plan(0, mixed, LAYER)
    assert torch.equal(backend.run(0, LAYER, q5, pool), reference.run(0, LAYER, q5, pool))
    assert backend.inner_plans == 1

    # A geometry the kernel does not take goes to the inner backend even on a decode step.
    wide = AttentionLayerSpec(2, 1, 512, 1.0)
    backend.plan(1, GroupBatch((1,), (3,), ((1,),), PAGE_SIZE), wide)
    assert backend.inner_plans == 2
    with pytest.raises(ValueError, match="cannot be captured"):
        backend.plan(1, GroupBatch((1,), (3,), ((1,),), PAGE_SIZE), wide, graph_bucket=1)


def test_decode_steps_past_kernel_rows_go_to_the_inner_backend() -> None:
    backend = _backend(kernel_rows=2)
    pool, q = _pool_and_q(3, seed=4)
    backend.plan(0, DECODE, LAYER)  # three rows: past the limit
    reference = TorchAttention()
    reference.plan(0, DECODE, LAYER)
    assert torch.equal(backend.run(0, LAYER, q, pool), reference.run(0, LAYER, q, pool))
    assert (backend.decode_plans, backend.inner_plans) == (0, 1)
    two = GroupBatch((1, 1), DECODE.kv_lens[:2], DECODE.page_tables[:2], PAGE_SIZE)
    backend.plan(0, two, LAYER)
    unlimited = _backend()
    unlimited.plan(0, two, LAYER)
    assert torch.equal(backend.run(0, LAYER, q[:2], pool), unlimited.run(0, LAYER, q[:2], pool))
    assert (backend.decode_plans, backend.inner_plans) == (1, 1)
    padded = GroupBatch((1,) * 4, (*DECODE.kv_lens, 1), (*DECODE.page_tables, (PADDING_PAGE,)), PAGE_SIZE)
    with pytest.raises(ValueError, match="cannot be captured"):  # a graph bucket past it: the inner's
        backend.plan(0, padded, LAYER, graph_bucket=4)
    assert backend.sibling().kernel_rows == 2
    with pytest.raises(ValueError, match="kernel_rows=0"):
        _backend(kernel_rows=0)


def test_the_kernel_takes_every_decode_step_unless_flashinfer_is_faster_and_may_be() -> None:
    from models.device_choice import triton_kernel_rows

    flashinfer = type("FlashInferStandIn", (TorchAttention,), {"name": "flashinfer"})()
    assert triton_kernel_rows("tuned", flashinfer) == KERNEL_ROWS
    # Batch invariance: a row's kernel must not follow the batch.
    assert triton_kernel_rows("invariant", flashinfer) is None
    # Nothing measured it against another backend, and the torch one cannot be graphed.
    assert triton_kernel_rows("tuned", TorchAttention()) is None


def test_the_split_size_follows_the_rows_only_where_the_kernel_may_follow_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kernels.attention.triton_decode_backend as module

    monkeypatch.setattr(module, "SPLIT_TOKENS_BY_ROWS", ((1, 32), (4, 128)))
    tuned = _backend(kernel_rows=8)
    assert [tuned.split_tokens(rows) for rows in (1, 2, 4, 5, 8)] == [32, 128, 128, 64, 64]
    assert _backend(kernel_rows=None).split_tokens(1) == 64  # invariant: one split size for every batch
    pool, q = _pool_and_q(3, seed=6)
    tuned.plan(0, DECODE, LAYER)  # three rows: 128-token splits
    table = torch.tensor(
        [[5, 9, 0, 0, 0], [1, 2, 3, 4, 6], [7, 0, 0, 0, 0]], dtype=torch.int32, device=DEVICE
    )
    lens = torch.tensor(DECODE.kv_lens, dtype=torch.int32, device=DEVICE)
    want = decode_attention(q, pool, table, lens, LAYER, split_tokens=128)
    assert torch.equal(tuned.run(0, LAYER, q, pool), want)


def test_the_shared_scratch_holds_the_rows_the_kernel_serves() -> None:
    """With `kernel_rows` set no kernel step is wider, so the scratch is sized for the smaller of it
    and `max_rows` (4 rows, not 256, for the CUDA default at Qwen3-4B's 256 sequences)."""
    pool, q = _pool_and_q(3, seed=5)
    for max_rows, kernel_rows, want in ((256, 4, 4), (8, None, 8), (8, 16, 8)):
        backend = _backend(max_rows=max_rows, kernel_rows=kernel_rows)
        backend.plan(0, DECODE, LAYER)  # three rows: the first plan allocates the shared scratch
        plan = backend._active[0]
        assert plan is not None and backend.decode_plans == 1
        assert plan.scratch.rows == want, (max_rows, kernel_rows)
    # The 4-row scratch serves a 4-row graph bucket, and the eager step's bits are the unlimited ones.
    backend = _backend(max_rows=256, kernel_rows=4)
    backend.plan(0, DECODE, LAYER)
    eager = backend.run(0, LAYER, q, pool)
    unlimited = _backend()
    unlimited.plan(0, DECODE, LAYER)
    assert torch.equal(eager, unlimited.run(0, LAYER, q, pool))
    padded = GroupBatch((1,) * 4, (*DECODE.kv_lens, 1), (*DECODE.page_tables, (PADDING_PAGE,)), PAGE_SIZE)
    backend.plan(0, padded, LAYER, graph_bucket=4)
    plan = backend._active[0]
    assert plan is not None and plan.scratch.rows == 4 and backend.decode_plans == 2


def test_graph_buckets_rewrite_fixed_buffers_and_match_the_eager_bits() -> None:
    backend = _backend()
    pool, q = _pool_and_q(4, seed=2)
    # A bucket of 4: three live rows and a filler row on the padding page.
    padded = GroupBatch((1,) * 4, (*DECODE.kv_lens, 1), (*DECODE.page_tables, (PADDING_PAGE,)), PAGE_SIZE)
    backend.plan(0, padded, LAYER, graph_bucket=4)
    plan = backend._active[0]
    assert plan is not None
    addresses = (plan.page_table.data_ptr(), plan.kv_lens.data_ptr(), plan.scratch.acc.data_ptr())
    graphed = backend.run(0, LAYER, q, pool)
    eager = _backend()
    eager.plan(0, DECODE, LAYER)
    assert torch.equal(graphed[:3], eager.run(0, LAYER, q[:3], pool))

    other = GroupBatch(
        (1,) * 4, (40, 2, 1, 1), ((8, 10, 11), (12,), (PADDING_PAGE,), (PADDING_PAGE,)), PAGE_SIZE
    )
    backend.plan(0, other, LAYER, graph_bucket=4)
    plan = backend._active[0]
    assert plan is not None
    assert (plan.page_table.data_ptr(), plan.kv_lens.data_ptr(), plan.scratch.acc.data_ptr()) == addresses
    eager.plan(0, GroupBatch((1, 1), (40, 2), ((8, 10, 11), (12,)), PAGE_SIZE), LAYER)
    assert torch.equal(backend.run(0, LAYER, q, pool)[:2], eager.run(0, LAYER, q[:2], pool))

    with pytest.raises(ValueError, match="exactly 4 rows"):
        backend.plan(0, DECODE, LAYER, graph_bucket=4)
    with pytest.raises(ValueError, match="exceeds max_rows=8"):
        backend.plan(0, GroupBatch((1,) * 9, (1,) * 9, ((1,),) * 9, PAGE_SIZE), LAYER, graph_bucket=9)


def test_sibling_owns_its_buffers_and_warm_up_builds_each_geometry_once() -> None:
    backend = _backend()
    backend.plan(0, DECODE, LAYER, graph_bucket=None)
    sibling = backend.sibling()
    assert isinstance(sibling, TritonDecodeAttention) and sibling.inner is not backend.inner
    sibling.plan(0, DECODE, LAYER)
    own, theirs = backend._active[0], sibling._active[0]
    assert own is not None and theirs is not None
    assert own.scratch.acc.data_ptr() != theirs.scratch.acc.data_ptr()

    sliding = AttentionLayerSpec(8, 2, 128, 128**-0.5, window=32)
    steps = backend.warm_up_steps([LAYER, LAYER, sliding, AttentionLayerSpec(2, 1, 512, 1.0)], PAGE_SIZE)
    assert [s.description for s in steps] == [
        "triton decode · 8/2 heads, head dim 128",
        "triton decode · 8/2 heads, head dim 128, window 32",
    ]
    for step in steps:
        step.run()


def _greedy_tokens(checkpoint: Path, backend: str) -> tuple[dict[str, list[int]], object]:
    engine = EngineConfig(max_num_batched_tokens=64, num_kv_pages=64, max_num_seqs=4)
    options = ModelOptions(engine=engine, device=str(DEVICE), dtype="float32", attention_backend=backend)
    loaded = load_model(str(checkpoint), options)
    scheduler = loaded.scheduler
    assert isinstance(scheduler, BatchScheduler)
    prompts = [tuple(range(40, 40 + n)) for n in (5, 21, 12)]
    for i, prompt in enumerate(prompts):
        scheduler.submit(Request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    tokens: dict[str, list[int]] = {}
    while scheduler.has_work():
        for update in scheduler.step().updates:
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
    return tokens, scheduler.runner


def test_tiny_qwen3_decodes_the_torch_backends_tokens(tiny_qwen3: Path) -> None:
    want, _ = _greedy_tokens(tiny_qwen3, "torch")
    got, runner = _greedy_tokens(tiny_qwen3, "triton")
    attention = runner.attention  # type: ignore[attr-defined]
    assert isinstance(attention, TritonDecodeAttention)
    assert attention.decode_plans > 0 and attention.inner_plans > 0  # both paths ran
    assert got == want and all(len(t) == 12 for t in want.values())


def test_p_in_the_storage_dtype_reaches_every_kernel_launch(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PV_STORAGE`: every launch of the kernel (warm-up and serving) takes the backend's setting.
    The tiny checkpoint is fp32, whose program has no P to round: the tokens stay the same."""
    want, _ = _greedy_tokens(tiny_qwen3, "triton")
    seen: list[object] = []
    real = triton_decode_backend.decode_attention

    def launch(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(kwargs.get("pv_storage"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_decode_backend, "decode_attention", launch)
    for setting in (True, False):
        seen.clear()
        monkeypatch.setattr(triton_decode_backend, "PV_STORAGE", setting)
        got, _ = _greedy_tokens(tiny_qwen3, "triton")
        assert got == want
        assert seen and set(seen) == {setting}, seen


def test_pick_attention_builds_it_and_refuses_a_cpu_without_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from models.device_choice import pick_attention
    from models.registry import ModelLoadError

    options = ModelOptions(engine=EngineConfig(max_num_seqs=3), attention_backend="triton")
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what the CPU tests run under (set here for a GPU box)
    backend = pick_attention(options, cpu, torch.float32, max_pages_per_seq=4)
    assert isinstance(backend, TritonDecodeAttention) and isinstance(backend.inner, TorchAttention)
    assert backend.max_rows == 3
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ModelLoadError, match=r"triton on cpu.*needs a CUDA device"):
        pick_attention(options, cpu, torch.float32, max_pages_per_seq=4)
    with pytest.raises(ModelLoadError, match="available: torch, flashinfer, triton"):
        pick_attention(ModelOptions(attention_backend="cutlass"), cpu, torch.float32, max_pages_per_seq=4)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_cuda_default_is_triton_unless_the_policy_is_end_to_end_invariant(
    monkeypatch: pytest.MonkeyPatch, policy: str, cuda_like: torch.device
) -> None:
    from kernels.attention.flashinfer_backend import FlashInferAttention
    from models.device_choice import pick_attention

    # An importable stand-in for flashinfer (a spec, so find_spec finds it); the backend's
    # constructor only imports it and allocates its workspace, which the stand-in zeros skip.
    fake = types.ModuleType("flashinfer")
    fake.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: torch.empty(0))
    options = ModelOptions(engine=EngineConfig(numeric_policy=policy, max_num_seqs=256))
    backend = pick_attention(options, cuda_like, torch.bfloat16, 8)
    if is_end_to_end_invariant(policy):
        assert type(backend) is FlashInferAttention and backend.batch_invariant
    else:
        assert isinstance(backend, TritonDecodeAttention)
        assert type(backend.inner) is FlashInferAttention and not backend.inner.batch_invariant
        assert (backend.kernel_rows, backend.max_rows) == (KERNEL_ROWS, 256)
    assert pick_attention(options, cuda_like, torch.float16, 8).name == backend.name
    assert backend.name == ("flashinfer" if policy in ("invariant", "per-token") else "triton")
    # fp32 on CUDA, and any dtype on the CPU: the torch backend.
    assert type(pick_attention(options, cuda_like, torch.float32, 8)) is TorchAttention
    for dtype in (torch.float32, torch.bfloat16):
        assert type(pick_attention(options, torch.device("cpu"), dtype, 8)) is TorchAttention


def test_the_cuda_default_without_flashinfer_says_it_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, cuda_like: torch.device
) -> None:
    from models.device_choice import pick_attention
    from models.registry import ModelLoadError

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # find_spec: None; import: ImportError
    with pytest.raises(ModelLoadError, match="flashinfer: flashinfer is not installed"):
        pick_attention(ModelOptions(), cuda_like, torch.bfloat16, 8)
