"""The KV pool's order in memory (kernels/kv_layout.py, ``POOL_ORDER``) changes where bytes lie and
nothing a model computes: every consumer but FlashInfer indexes the one logical shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_batch_scheduler import Outcome, drive, prompts, requests_for  # the sibling module

import kernels.kv_layout as kv_layout
from engine.config import EngineConfig
from engine.scheduler import BatchScheduler
from kernels.kv_layout import KVLayoutError, KVPoolLayout, flashinfer_view
from models.registry import ModelOptions, load_model


def test_an_hnd_pool_has_the_logical_shape_and_lies_head_major(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = KVPoolLayout(layers=3, pages=5, kv_heads=4, head_dim=8)
    nhd = layout.allocate(torch.float32)
    monkeypatch.setattr(kv_layout, "POOL_ORDER", "HND")
    hnd = layout.allocate(torch.float32)
    assert hnd.shape == nhd.shape == layout.shape and not hnd.any()
    # [layers, pages, 2, 16, heads, dim] viewed over memory [layers, pages, 2, heads, 16, dim].
    assert hnd.stride()[2:] == (4 * 16 * 8, 8, 16 * 8, 1)
    assert nhd.stride()[2:] == (16 * 4 * 8, 4 * 8, 8, 1)
    assert flashinfer_view(hnd[1], "HND").shape == (5, 2, 4, 16, 8)
    assert flashinfer_view(nhd[1], "NHD").data_ptr() == nhd[1].data_ptr()
    with pytest.raises(KVLayoutError, match="does not lie in HND order"):
        flashinfer_view(nhd[1], "HND")
    with pytest.raises(KVLayoutError, match="does not lie in NHD order"):
        flashinfer_view(hnd[1], "NHD")
    monkeypatch.setattr(kv_layout, "POOL_ORDER", "DHN")
    with pytest.raises(KVLayoutError, match="KV pool order 'DHN' \\(INFER_KV_POOL_ORDER\\)"):
        layout.allocate(torch.float32)


def _greedy(checkpoint: Path) -> tuple[Outcome, list[torch.Tensor]]:
    engine = EngineConfig(max_num_batched_tokens=16, num_kv_pages=64)
    loaded = load_model(str(checkpoint), ModelOptions(engine=engine, device="cpu"))
    assert isinstance(loaded.scheduler, BatchScheduler)
    reqs = requests_for(prompts(4, 5, 40, seed=3), max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    outcome = drive(loaded.scheduler, reqs)
    return outcome, loaded.scheduler.runner.model.kv.pools  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_a_model_gives_the_same_bits_over_either_pool_order(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    checkpoint = Path(request.getfixturevalue(f"tiny_{family}"))
    nhd, nhd_pools = _greedy(checkpoint)
    monkeypatch.setattr(kv_layout, "POOL_ORDER", "HND")
    hnd, hnd_pools = _greedy(checkpoint)
    # The second run's pools lie head-major wherever a page holds more than one head.
    assert [p.stride() for p in hnd_pools] != [p.stride() for p in nhd_pools]
    assert all(p.transpose(4, 3).is_contiguous() for p in hnd_pools)
    assert hnd.tokens == nhd.tokens and hnd.terminals == nhd.terminals
    assert hnd.logprobs == nhd.logprobs  # exactly: the same values are read, only from elsewhere
