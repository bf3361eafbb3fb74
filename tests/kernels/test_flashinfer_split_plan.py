"""What FlashInferAttention asks FlashInfer's planners for, without FlashInfer or a GPU.

A stand-in `flashinfer` module records every wrapper's `plan` call. Under `batch_invariant` every
plan (eager prefill, eager decode, graph decode) must disable the KV split, so no row's reduction
order follows the batch; without it FlashInfer keeps its own choice, except that a graph bucket
whose rows × KV heads fill the SMs plans without the split (the backend's module doc says why).
The numerics themselves are the GPU gate `batch_invariance_is_bitwise`.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from kernels.attention.base import AttentionLayerSpec, GroupBatch
from kernels.gemm.names import POLICY_NAMES, is_end_to_end_invariant
from models.registry import ModelOptions

SPLIT_ARGUMENTS = ("disable_split_kv", "fixed_split_size")
LAYER = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.5, window=32)


class _RecordingWrapper:
    """Records plans, and resolves backend="auto" at its first plan and keeps it, as FlashInfer's
    wrappers do — refusing, as FlashInfer's JIT does, to build fa3 past head dim 256."""

    def __init__(self, log: list[tuple[str, dict[str, Any]]], kind: str, *_: object, **options: Any) -> None:
        self.log, self.kind, self.options = log, kind, options
        self.resolved: str | None = None

    def plan(self, *args: Any, **kwargs: Any) -> None:
        head_dim = int(args[-2])  # every plan ends its positional arguments with head dim, page size
        if self.resolved is None:
            asked = self.options.get("backend", "auto")
            self.resolved = ("fa3" if head_dim <= 256 else "fa2") if asked == "auto" else asked
        if self.resolved == "fa3" and head_dim > 256:
            raise RuntimeError(f"static_assert: fa3 has no head dim {head_dim} kernel")
        self.log.append((self.kind, {**kwargs, "constructed_with": self.options, "args": args}))

    def run(self, q: torch.Tensor, _pool: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        assert out.shape == q.shape and out.dtype == q.dtype
        self.log.append((f"{self.kind} run", {"rows": q.shape[0]}))
        return q


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    log: list[tuple[str, dict[str, Any]]] = []
    fake = types.ModuleType("flashinfer")

    def prefill(*args: object, **kwargs: Any) -> _RecordingWrapper:
        return _RecordingWrapper(log, "prefill", *args, **kwargs)

    def decode(*args: object, **kwargs: Any) -> _RecordingWrapper:
        kind = "graph-decode" if kwargs.get("use_cuda_graph") else "decode"
        return _RecordingWrapper(log, kind, *args, **kwargs)

    fake.BatchPrefillWithPagedKVCacheWrapper = prefill  # type: ignore[attr-defined]
    fake.BatchDecodeWithPagedKVCacheWrapper = decode  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr("kernels.attention.flashinfer_backend.WORKSPACE_BYTES", 64)
    yield log


def _plan_every_path(batch_invariant: bool) -> None:
    from kernels.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention(torch.device("cpu"), torch.bfloat16, 8, batch_invariant=batch_invariant)
    mixed = GroupBatch(q_lens=(5, 1), kv_lens=(5, 40), page_tables=((1,), (2, 3, 4)), page_size=16)
    decode = GroupBatch(q_lens=(1, 1), kv_lens=(17, 40), page_tables=((5, 6), (2, 3, 4)), page_size=16)
    backend.plan(0, mixed, LAYER)
    backend.plan(0, decode, LAYER)
    backend.plan(0, decode, LAYER, graph_bucket=2)


def test_batch_invariant_plans_disable_the_kv_split_on_every_path(
    plans: list[tuple[str, dict[str, Any]]],
) -> None:
    _plan_every_path(batch_invariant=True)
    assert [kind for kind, _ in plans] == ["prefill", "decode", "graph-decode"]
    for kind, kwargs in plans:
        assert kwargs.get("disable_split_kv") is True, f"{kind} plan: {kwargs}"
        assert "fixed_split_size" not in kwargs, f"{kind} plan: {kwargs}"


def test_default_plans_leave_the_split_to_flashinfer(plans: list[tuple[str, dict[str, Any]]]) -> None:
    _plan_every_path(batch_invariant=False)
    assert [kind for kind, _ in plans] == ["prefill", "decode", "graph-decode"]
    for kind, kwargs in plans:
        assert not set(SPLIT_ARGUMENTS) & set(kwargs), f"{kind} plan: {kwargs}"


def test_graph_buckets_that_fill_the_sms_plan_without_the_split(
    plans: list[tuple[str, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 8 SMs and LAYER's 2 KV heads: a 2-row bucket (4 work items) keeps FlashInfer's split, a
    4-row bucket (8) switches it off; an eager 4-row decode leaves it to FlashInfer's eager planner."""
    from kernels.attention import flashinfer_backend

    monkeypatch.setattr(flashinfer_backend, "_sm_count", lambda device: 8)  # a CPU device has none
    backend = flashinfer_backend.FlashInferAttention(torch.device("cpu"), torch.bfloat16, 8)
    two = GroupBatch(q_lens=(1, 1), kv_lens=(17, 40), page_tables=((5, 6), (2, 3, 4)), page_size=16)
    four = GroupBatch((1,) * 4, (17, 40, 1, 16), ((5, 6), (2, 3, 4), (7,), (8,)), page_size=16)
    backend.plan(0, two, LAYER, graph_bucket=2)
    backend.plan(0, four, LAYER, graph_bucket=4)
    backend.plan(0, four, LAYER)
    assert [(kind, kwargs.get("disable_split_kv")) for kind, kwargs in plans] == [
        ("graph-decode", None),
        ("graph-decode", True),
        ("decode", None),
    ]


def test_decode_plans_take_each_rows_first_pages_in_order(plans: list[tuple[str, dict[str, Any]]]) -> None:
    """The paged arguments against their definition: row i holds ceil(kv_i / page) pages, the first
    ones of its table (a table may run longer), concatenated in row order; the last page holds the rest."""
    from kernels.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention(torch.device("cpu"), torch.bfloat16, 8)
    tables = ((7, 8, 9), (1,), (4, 5, 6, 2), (3, 11))
    kv_lens = (33, 16, 48, 1)
    backend.plan(0, GroupBatch((1, 1, 1, 1), kv_lens, tables, 16), LAYER)
    indptr, indices, last_page_len = plans[-1][1]["args"][:3]
    assert indptr.tolist() == [0, 3, 4, 7, 8]
    assert indices.tolist() == [7, 8, 9, 1, 4, 5, 6, 3]
    assert last_page_len.tolist() == [1, 16, 16, 1]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_model_lines_pick_the_split_from_the_policy(
    plans: list[tuple[str, dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
    cuda_like: torch.device,
) -> None:
    from models import device_choice

    # pick_attention refuses flashinfer off CUDA before building it; the device check is not what is
    # under test here, so the CPU device is passed off as CUDA by its type only.
    options = ModelOptions(engine=EngineConfig(numeric_policy=policy), attention_backend="flashinfer")
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: torch.empty(0))
    backend = device_choice.pick_attention(options, cuda_like, torch.bfloat16, 8)
    assert getattr(backend, "batch_invariant", None) is is_end_to_end_invariant(policy)
    assert is_end_to_end_invariant(policy) is (policy in ("invariant", "per-token"))


def test_warm_up_builds_each_geometry_once_without_touching_the_backends_plans(
    plans: list[tuple[str, dict[str, Any]]],
) -> None:
    """Start-up's JIT warm-up: a prefill and a decode per distinct geometry (the window's size
    does not change the compiled kernel, its presence does), run on a scratch instance."""
    from kernels.attention.flashinfer_backend import FlashInferAttention
    from kernels.attention.torch_backend import TorchAttention

    backend = FlashInferAttention(torch.device("cpu"), torch.bfloat16, 8, batch_invariant=True)
    other_window = AttentionLayerSpec(4, 2, 8, 1.0, window=64)
    full = AttentionLayerSpec(4, 1, 16, 1.0)
    steps = backend.warm_up_steps([LAYER, other_window, full], page_size=16)
    assert [step.description.split(" · ")[0] for step in steps] == ["prefill", "decode"] * 2
    assert "window 32" in steps[0].description and "head dim 16" in steps[2].description
    for step in steps:
        step.run()
    assert [kind for kind, _ in plans] == ["prefill", "prefill run", "decode", "decode run"] * 2
    assert all(kwargs.get("disable_split_kv") is True for kind, kwargs in plans if "run" not in kind)
    assert not backend._active, "warm-up planned on the backend itself"
    assert TorchAttention().warm_up_steps([LAYER], page_size=16) == []


@pytest.mark.parametrize(("head_dim", "expected"), [(128, "auto"), (256, "auto"), (512, "fa2")])
def test_every_wrapper_names_fa2_past_the_hopper_kernels_head_dims(
    plans: list[tuple[str, dict[str, Any]]], head_dim: int, expected: str
) -> None:
    """FlashInfer's fa3 kernels do not compile at head dim 512, and its tensor-core decode wrapper
    picks fa3 without looking at the head dim: every wrapper (prefill, decode, graph decode) of a
    group with Gemma 4's global geometry is built for fa2; smaller head dims keep FlashInfer's
    choice."""
    from kernels.attention.flashinfer_backend import FlashInferAttention

    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=1, head_dim=head_dim, scale=0.5)
    backend = FlashInferAttention(torch.device("cpu"), torch.bfloat16, 8)
    mixed = GroupBatch(q_lens=(5, 1), kv_lens=(5, 40), page_tables=((1,), (2, 3, 4)), page_size=16)
    decode = GroupBatch(q_lens=(1, 1), kv_lens=(17, 40), page_tables=((5, 6), (2, 3, 4)), page_size=16)
    backend.plan(0, mixed, layer)
    backend.plan(0, decode, layer)
    backend.plan(0, decode, layer, graph_bucket=2)
    assert [kind for kind, _ in plans] == ["prefill", "decode", "graph-decode"]
    for kind, kwargs in plans:
        assert kwargs["constructed_with"].get("backend") == expected, f"{kind}: {kwargs['constructed_with']}"


def test_one_group_planned_at_two_head_dims_uses_a_wrapper_per_head_dim(
    plans: list[tuple[str, dict[str, Any]]],
) -> None:
    """The start-up warm-up plans every geometry on one scratch group: Gemma 4's sliding layers
    (head dim 256) and then its global ones (512). A wrapper resolved to fa3 at 256 must not be
    asked for 512 (on the H200 that failed FlashInfer's JIT and every Gemma 4 start-up)."""
    from kernels.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention(torch.device("cpu"), torch.bfloat16, 8)
    sliding = AttentionLayerSpec(16, 8, 256, 1.0, window=1024)
    global_ = AttentionLayerSpec(16, 1, 512, 1.0)
    for step in backend.warm_up_steps([sliding, global_], page_size=16):
        step.run()
    decode = GroupBatch(q_lens=(1, 1), kv_lens=(17, 40), page_tables=((5, 6), (2, 3, 4)), page_size=16)
    for layer in (sliding, global_, sliding):
        backend.plan(0, decode, layer)
        backend.plan(0, decode, layer, graph_bucket=2)
    assert [kind for kind, _ in plans if "run" not in kind].count("graph-decode") == 3


def test_float32_on_cuda_takes_torch_attention_and_refuses_flashinfer_by_name(
    cuda_like: torch.device,
) -> None:
    """FlashInfer has no fp32 kernels (its JIT raised a bare KeyError on the H100, 2026-12-05): an
    fp32 model on CUDA gets the torch backend by default, and asking for FlashInfer names why not."""
    from kernels.attention.torch_backend import TorchAttention
    from models import device_choice
    from models.registry import ModelLoadError

    backend = device_choice.pick_attention(ModelOptions(), cuda_like, torch.float32, 8)
    assert isinstance(backend, TorchAttention)
    with pytest.raises(
        ModelLoadError, match=r"flashinfer with dtype torch\.float32: .*bfloat16 and float16 only"
    ):
        device_choice.pick_attention(
            ModelOptions(attention_backend="flashinfer"),
            cuda_like,
            torch.float32,
            8,
        )


def test_page_indices_reach_the_planner_whether_or_not_inference_mode_is_on() -> None:
    """Start-up's profiling steps plan under ``torch.inference_mode`` and the graph captures plan
    outside it (the H100 run at 6593fba failed every CUDA-graph engine start there): the index buffers must
    take writes in both modes, and grow past their first size without losing a group's indices."""
    import numpy as np

    from kernels.attention.flashinfer_backend import _DeviceIndices

    indices = _DeviceIndices(torch.device("cpu"))
    with torch.inference_mode():
        first = indices.put(0, np.arange(5, dtype=np.int32)).clone()
    reused = indices.put(0, np.arange(20, 27, dtype=np.int32)).clone()  # the same buffer, mode off
    grown = indices.put(0, np.arange(7, 3000, dtype=np.int32))  # past the first buffer's 1024
    other_group = indices.put(1, np.array([9, 8], dtype=np.int32))
    with torch.inference_mode():
        last = indices.put(0, np.array([4, 2], dtype=np.int32))
    assert first.tolist() == list(range(5)) and reused.tolist() == list(range(20, 27))
    assert grown.shape == (2993,) and grown[-1].item() == 2999
    assert last.tolist() == [4, 2] and other_group.tolist() == [9, 8]
