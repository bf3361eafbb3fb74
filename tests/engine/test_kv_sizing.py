"""Each KV group's own page count (engine/kv/sizing.py): the split arithmetic, the promise that a
sliding group sized this way never refuses a request the full group can hold, and the tiny Gemma 4
served from two pools of different sizes with the greedy tokens transformers generates."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.contract import Finished, Request
from engine.kv import KVGroupSpec, KVManager
from engine.kv.sizing import (
    KVGroupCost,
    configured_kv_pages,
    sliding_need,
    split_kv_bytes,
    split_kv_pages,
)
from gates.harness.hf_reference import hf_greedy, hf_model
from gates.harness.serving import batch_scheduler, drive, greedy, load_for_gate, random_prompt
from kernels.kv_layout import PAGE_SIZE, pages_for
from models.gemma4.config import GLOBAL, SLIDING

PAGE = PAGE_SIZE

# -- the arithmetic -------------------------------------------------------------------------------


def test_sliding_need_is_every_sequence_at_its_most_live_pages_plus_padding() -> None:
    # Window 12, chunks of 32: a chunk reads 12 + 32 - 1 = 43 positions, which straddle at most
    # (12 + 32 - 2) // 16 + 2 = 4 pages; 3 sequences of 4 pages, plus page 0.
    assert sliding_need(12, 4096, 3, 32) == 3 * 4 + 1
    # A context shorter than the window plus a chunk never needs more than it covers: 2 pages.
    assert sliding_need(12, 20, 3, 32) == 3 * 2 + 1


def test_num_kv_pages_is_the_full_groups_count_and_caps_the_sliding_ones() -> None:
    groups = (KVGroupCost(300, sliding_need=13), KVGroupCost(100))
    assert split_kv_pages(64, groups) == (13, 64)
    assert split_kv_pages(10, groups) == (10, 10)  # capped: never more than the full group
    assert split_kv_pages(2, groups) == (2, 2)


def test_kv_bytes_give_the_sliding_group_its_need_and_the_full_group_the_rest() -> None:
    groups = (KVGroupCost(300, sliding_need=13), KVGroupCost(100))
    sliding, full = split_kv_bytes(100_000, groups)
    assert (sliding, full) == (13, (100_000 - 13 * 300) // 100)
    # Capped: 10 pages each take exactly 4000 bytes; one more full page would not fit.
    assert split_kv_bytes(4000, groups) == (10, 10)
    assert split_kv_bytes(4099, groups) == (10, 10)
    # Two pages per group at the least, as one shared count always had.
    assert split_kv_bytes(0, groups) == (2, 2)


def test_kv_bytes_fill_the_budget_as_far_as_a_full_page_goes() -> None:
    rng = random.Random(5)
    for _ in range(300):
        groups = tuple(
            KVGroupCost(rng.randint(1, 5000), rng.choice([None, rng.randint(2, 400)]))
            for _ in range(rng.randint(1, 4))
        )
        kv_bytes = rng.randint(0, 3_000_000)
        pages = split_kv_bytes(kv_bytes, groups)
        used = sum(g.bytes_per_page * n for g, n in zip(groups, pages, strict=True))
        full = [n for g, n in zip(groups, pages, strict=True) if g.sliding_need is None]
        assert len(set(full)) <= 1, pages
        top = full[0] if full else max(pages)
        for g, n in zip(groups, pages, strict=True):
            assert n >= 2
            if g.sliding_need is not None:
                assert n == min(g.sliding_need, top), (groups, pages)
        if min(pages) > 2:
            assert used <= kv_bytes, (groups, kv_bytes, pages)
        if full and used <= kv_bytes:
            # One more full-group page (and whatever that uncaps) would not fit.
            assert (
                sum(
                    g.bytes_per_page * n for g, n in zip(groups, split_kv_pages(top + 1, groups), strict=True)
                )
                > kv_bytes
            )


def test_a_model_without_sliding_groups_is_sized_as_before() -> None:
    for per_page, kv_bytes in [(4096, 1 << 30), (1000, 999_999), (7, 13), (1 << 20, 5)]:
        assert split_kv_bytes(kv_bytes, (KVGroupCost(per_page),)) == (max(2, kv_bytes // per_page),)
        assert split_kv_bytes(kv_bytes, (KVGroupCost(per_page), KVGroupCost(3 * per_page))) == (
            (max(2, kv_bytes // (4 * per_page)),) * 2
        )
    assert split_kv_pages(77, (KVGroupCost(4096),)) == (77,)


def test_a_model_with_only_sliding_groups_gets_its_needs() -> None:
    groups = (KVGroupCost(10, sliding_need=9), KVGroupCost(20, sliding_need=5))
    assert split_kv_bytes(1 << 20, groups) == (9, 5)
    assert split_kv_pages(7, groups) == (7, 5)


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="got 1"):
        split_kv_pages(1, (KVGroupCost(8),))
    with pytest.raises(ValueError, match=r"bytes_per_page .* got 0"):
        KVGroupCost(0)
    with pytest.raises(ValueError, match=r"sliding_need .* got 1"):
        KVGroupCost(8, sliding_need=1)
    with pytest.raises(ValueError, match="got -1"):
        split_kv_bytes(-1, (KVGroupCost(8),))


def test_the_sliding_group_never_refuses_what_the_full_group_holds() -> None:
    """The scheduler refuses (kv_budget) a request whose most live pages exceed a group's pool. For
    random shapes, every context the full group can hold passes the sliding group too."""
    rng = random.Random(11)
    for _ in range(150):
        window = rng.randint(1, 200)
        chunk = rng.randint(1, 300)
        max_len = rng.randint(1, 600)
        seqs = rng.randint(1, 8)
        need = sliding_need(window, max_len, seqs, chunk)
        groups = (KVGroupCost(rng.randint(1, 900), need), KVGroupCost(rng.randint(1, 900)))
        pages = (
            split_kv_pages(rng.randint(2, 60), groups)
            if rng.random() < 0.5
            else split_kv_bytes(rng.randint(0, 60_000), groups)
        )
        kv = KVManager([KVGroupSpec("sliding", pages[0], window), KVGroupSpec("full", pages[1])], "m")
        full_spec = kv.groups[1].spec
        for positions in range(1, max_len + 1):
            short = kv.shortfall(positions, chunk)
            if pages_for(positions) <= full_spec.allocatable_pages:
                assert short is None, (window, chunk, max_len, seqs, pages, positions, short)
            else:
                # Refused either way (the first short group is named; that may be the sliding one).
                assert short is not None


# -- the tiny Gemma 4 ------------------------------------------------------------------------------


def _hf_greedy(checkpoint: Path, prompts: list[tuple[int, ...]], new_tokens: int) -> list[list[int]]:
    """What tests/gemma4/test_http_serve.py holds the served tokens to: transformers' greedy."""
    hf = hf_model(checkpoint, torch.device("cpu"), torch.float32)
    return [hf_greedy(hf, prompt, new_tokens) for prompt in prompts]


def test_gemma4_serves_past_the_window_from_two_pool_sizes(tiny_gemma4: Path) -> None:
    config = json.loads((tiny_gemma4 / "config.json").read_text())
    window, vocab = config["sliding_window"], config["vocab_size"]
    chunk, seqs = 32, 2
    served = load_for_gate(
        tiny_gemma4, max_num_seqs=seqs, max_num_batched_tokens=chunk, max_model_len=256, num_kv_pages=48
    )
    sliding_pages = seqs * ((window + chunk - 2) // PAGE + 2) + 1
    assert sliding_pages < 48
    totals = {g.name: g.pages_total for g in served.scheduler.load().groups}
    assert totals == {SLIDING: sliding_pages - 1, GLOBAL: 47}

    new_tokens = window + 4
    lengths = (3 * window + 5, 5 * window, window + 3)  # three requests for two sequences' pages
    requests = [
        Request(f"r{i}", random_prompt(n, seed=40 + i, vocab_size=vocab), greedy(new_tokens, logprobs=None))
        for i, n in enumerate(lengths)
    ]
    peak: list[int] = []

    def watch(step: int, results: object) -> None:
        peak.append({g.name: g.pages_used for g in served.scheduler.load().groups}[SLIDING])

    results = drive(served, requests, after_step=watch)
    assert max(peak) <= sliding_pages - 1
    assert batch_scheduler(served).num_preemptions == 0  # the sliding pool was never what ran short
    expected = _hf_greedy(tiny_gemma4, [r.prompt_token_ids for r in requests], new_tokens)
    for request, want in zip(requests, expected, strict=True):
        got = results[request.request_id]
        assert isinstance(got.terminal, Finished) and got.terminal.completion_tokens == new_tokens, (
            got.terminal
        )
        assert got.tokens == want, request.request_id


def test_gemma4_kv_bytes_split_reports_each_groups_own_total(tiny_gemma4: Path) -> None:
    from engine.model_runner import PagedModelRunner

    served = load_for_gate(
        tiny_gemma4, num_kv_pages=None, kv_cache_memory=1 << 22, max_num_seqs=4, max_num_batched_tokens=64
    )
    runner = batch_scheduler(served).runner
    assert isinstance(runner, PagedModelRunner)
    per_page = runner.model.kv.bytes_per_page()
    window = json.loads((tiny_gemma4 / "config.json").read_text())["sliding_window"]
    need = 4 * ((window + 64 - 2) // PAGE + 2) + 1
    full = ((1 << 22) - need * per_page[0]) // per_page[1]
    totals = {g.name: g.pages_total for g in served.scheduler.load().groups}
    assert totals == {SLIDING: need - 1, GLOBAL: full - 1}
    # The same bytes as one shared count would have given the global group far fewer pages.
    assert full > 2 * ((1 << 22) // sum(per_page))


def test_qwen3_pool_is_sized_as_before(tiny_qwen3: Path) -> None:
    from engine.model_runner import PagedModelRunner

    served = load_for_gate(tiny_qwen3, num_kv_pages=None, kv_cache_memory=1 << 22)
    runner = batch_scheduler(served).runner
    assert isinstance(runner, PagedModelRunner)
    (per_page,) = runner.model.kv.bytes_per_page()
    assert [g.pages_total for g in served.scheduler.load().groups] == [(1 << 22) // per_page - 1]
    assert [g.pages_total for g in load_for_gate(tiny_qwen3, num_kv_pages=33).scheduler.load().groups] == [32]


def test_engine_config_keeps_num_kv_pages_winning() -> None:
    # --num-kv-pages wins over --kv-cache-memory, as the engine config documents.
    groups = (KVGroupCost(300, sliding_need=13), KVGroupCost(100))
    both = EngineConfig(num_kv_pages=20, kv_cache_memory=1 << 30)
    assert configured_kv_pages(both, groups) == (13, 20)
    assert configured_kv_pages(EngineConfig(kv_cache_memory=4000), groups) == (10, 10)
    assert configured_kv_pages(EngineConfig(), groups) is None
