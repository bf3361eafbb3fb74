"""GPU gates for the FlashInfer attention backend against the reference backend (manifests/kernels.toml).

`kernels.attention.torch_backend` is the attention semantics (gather the pages, attend in fp32);
FlashInfer must agree with it on the geometries the model lines serve — Qwen3-4B, and Gemma 4's
sliding layers (head dim 256, window 1024) and global layers (head dim 512, one KV head), both at
scale 1 — for decode steps, mixed prefill steps and graph-mode decode replayed over a new batch.

Sliding-window tables are built as the engine leaves them: slots wholly outside every query's
window hold the padding page, and the padding page holds large values, so a backend that let an
out-of-window position through would be off by far more than bf16 rounding. Pages are shuffled so
the page indirection is exercised.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch
from kernels.attention.torch_backend import TorchAttention
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE, pages_for

# bf16 inputs, fp32 reference: FlashInfer rounds P to bf16 before P·V, so outputs carry ~2^-8
# relative error; 2 % of the output's scale leaves room for that and nothing a wrong mask,
# window or page would stay under (those move outputs by O(1) of their scale).
RELATIVE_BOUND = 0.02
POOL_PAGES = 1024
PADDING_VALUE = 50.0


@dataclass(frozen=True)
class Geometry:
    name: str
    layer: AttentionLayerSpec


QWEN3_4B = Geometry("qwen3-4b", AttentionLayerSpec(32, 8, 128, 1 / math.sqrt(128)))
GEMMA4_SLIDING = Geometry("gemma4-12b-sliding", AttentionLayerSpec(16, 8, 256, 1.0, window=1024))
GEMMA4_GLOBAL = Geometry("gemma4-12b-global", AttentionLayerSpec(16, 1, 512, 1.0))
GEOMETRIES = (QWEN3_4B, GEMMA4_SLIDING, GEMMA4_GLOBAL)

DECODE_KV_LENS = (1, 17, 1000, 1024, 1025, 1040, 3079)
MIXED = ((1, 1030), (37, 37), (1, 2000), (300, 1500), (1, 5))  # (q_len, kv_len)


def _tables(
    kv_lens: Sequence[int], q_lens: Sequence[int], window: int | None, seed: int
) -> tuple[tuple[int, ...], ...]:
    """Distinct shuffled pages per sequence; on a sliding layer, slots no query of the row can see
    hold the padding page (the engine's window release)."""
    free = list(range(1, POOL_PAGES))
    random.Random(seed).shuffle(free)
    tables = []
    for kv, q in zip(kv_lens, q_lens, strict=True):
        n = pages_for(kv)
        pages = [free.pop() for _ in range(n)]
        if window is not None:
            first_visible = max(0, kv - q - window + 1)  # the earliest query's window start
            pages = [PADDING_PAGE if (i + 1) * PAGE_SIZE <= first_visible else p for i, p in enumerate(pages)]
        tables.append(tuple(pages))
    return tuple(tables)


def _pool(layer: AttentionLayerSpec, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (POOL_PAGES, 2, PAGE_SIZE, layer.num_kv_heads, layer.head_dim)
    pool = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    # Q·K of std ~ sqrt(head_dim) at scale 1 (what Gemma's RMS-normed Q and K give) is fine; at
    # the pool's unit entries it would be too peaked to see a wrong position, so K is scaled down.
    pool[:, 0] /= layer.head_dim**0.25
    pool[PADDING_PAGE] = PADDING_VALUE
    return pool.to(torch.bfloat16)


def _poison_outside_windows(pool: torch.Tensor, batch: GroupBatch, layer: AttentionLayerSpec) -> None:
    """On a sliding layer, every position no query of its row may see, in pages the row still
    holds, gets the padding value too: a window off by one position then moves outputs by far
    more than rounding (the first invisible position is exactly the one it would let in)."""
    if layer.window is None:
        return
    for q, kv, table in zip(batch.q_lens, batch.kv_lens, batch.page_tables, strict=True):
        for position in range(max(0, kv - q - layer.window + 1)):
            page = table[position // PAGE_SIZE]
            if page != PADDING_PAGE:
                pool[page, :, position % PAGE_SIZE] = PADDING_VALUE


def _queries(n: int, layer: AttentionLayerSpec, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(n, layer.num_heads, layer.head_dim, generator=generator, device=device)
    return (q / layer.head_dim**0.25).to(torch.bfloat16)


def _run(
    backend: AttentionBackend,
    batch: GroupBatch,
    layer: AttentionLayerSpec,
    q: torch.Tensor,
    pool: torch.Tensor,
) -> torch.Tensor:
    backend.plan(0, batch, layer)
    return backend.run(0, layer, q, pool)


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), f"{name}: non-finite output"
    scale = float(want.float().abs().max())
    err = float((got.float() - want.float()).abs().max())
    print(f"{name}: max |Δ| {err:.3g} against output scale {scale:.3g} (bound {RELATIVE_BOUND * scale:.3g})")
    assert err <= RELATIVE_BOUND * scale, f"{name}: max |Δ| {err:.3g} > {RELATIVE_BOUND} × {scale:.3g}"


def _flashinfer(device: torch.device) -> AttentionBackend:
    from kernels.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(device, torch.bfloat16, max_pages_per_seq=POOL_PAGES)


def _eager_step_matches_reference(
    device: torch.device,
    geometry: Geometry,
    q_lens: tuple[int, ...],
    kv_lens: tuple[int, ...],
    seed: int,
    what: str,
) -> None:
    layer = geometry.layer
    batch = GroupBatch(q_lens, kv_lens, _tables(kv_lens, q_lens, layer.window, seed), PAGE_SIZE)
    pool = _pool(layer, device, seed)
    _poison_outside_windows(pool, batch, layer)
    q = _queries(sum(q_lens), layer, device, seed)
    want = _run(TorchAttention(), batch, layer, q, pool)
    _check(f"{geometry.name} {what}", _run(_flashinfer(device), batch, layer, q, pool), want)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g.name)
def test_decode_matches_reference(cuda_device: torch.device, geometry: Geometry) -> None:
    q_lens = (1,) * len(DECODE_KV_LENS)
    _eager_step_matches_reference(cuda_device, geometry, q_lens, DECODE_KV_LENS, 1, "decode")


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g.name)
def test_mixed_prefill_matches_reference(cuda_device: torch.device, geometry: Geometry) -> None:
    q_lens = tuple(q for q, _ in MIXED)
    kv_lens = tuple(kv for _, kv in MIXED)
    _eager_step_matches_reference(cuda_device, geometry, q_lens, kv_lens, 2, "mixed prefill")


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g.name)
def test_graph_decode_replays_a_new_batch(cuda_device: torch.device, geometry: Geometry) -> None:
    """Captured over one batch, replayed after planning another of the same bucket: the replay
    must attend the new batch's pages and lengths, as the engine's decode graphs rely on."""
    layer = geometry.layer
    bucket = 8
    backend = _flashinfer(cuda_device)
    pool = _pool(layer, cuda_device, 3)
    q = torch.zeros(bucket, layer.num_heads, layer.head_dim, dtype=torch.bfloat16, device=cuda_device)
    capture_lens = (1, 1, 1, 1, 1, 1, 1, 1)
    q_lens = (1,) * bucket
    backend.plan(
        0,
        GroupBatch(q_lens, capture_lens, _tables(capture_lens, q_lens, layer.window, 3), PAGE_SIZE),
        layer,
        graph_bucket=bucket,
    )
    backend.run(0, layer, q, pool)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.run(0, layer, q, pool)
    kv_lens = (3079, 1, 1025, 17, 1040, 1024, 2000, 999)
    batch = GroupBatch(q_lens, kv_lens, _tables(kv_lens, q_lens, layer.window, 4), PAGE_SIZE)
    _poison_outside_windows(pool, batch, layer)
    backend.plan(0, batch, layer, graph_bucket=bucket)
    q.copy_(_queries(bucket, layer, cuda_device, 4))
    graph.replay()
    torch.cuda.synchronize()
    want = _run(TorchAttention(), batch, layer, q, pool)
    _check(f"{geometry.name} graph replay", out, want)
