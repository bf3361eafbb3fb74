"""Prefix caching for a model with recurrent state (engine/kv/snapshots.py): snapshots at page
boundaries, hits only as deep as a snapshot, snapshots freed with their pages, a full snapshot pool
costing hits and never correctness, nothing leaked.

`StateSim` is the sim plus a recurrent state it checks: each slot holds the exact tokens its state
has consumed, slot copies move them, and every row asserts that its slot holds precisely the tokens
before its first position. A restore from a wrong snapshot, a snapshot taken at the wrong position
or a copy lost or misordered fails the step."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from engine.config import EngineConfig
from engine.contract import ContractError, Request, SamplingParams
from engine.kv.snapshots import SnapshotCache, SnapshotError
from engine.kv.state_pool import PADDING_SLOT, StatePools, StateShape
from engine.runner import ModelRunner, SampledToken, StepBatch
from engine.scheduler import BatchScheduler
from kernels.kv_layout import PAGE_SIZE
from models.sim import EOS_TOKEN_ID, VOCAB_SIZE, SimOptions, SimRunner


class StateSim:
    def __init__(self, inner: SimRunner) -> None:
        self.inner = inner
        self.state: dict[int, tuple[int, ...]] = {}
        self.chunks: dict[str, list[tuple[int, int]]] = {}
        self.fail_next = False

    def _copy(self, copies: tuple[tuple[int, int], ...]) -> None:
        for src, dst in copies:
            assert PADDING_SLOT not in (src, dst), copies
            self.state[dst] = self.state[src]

    def execute(self, batch: StepBatch) -> list[SampledToken | None]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected step failure")
        self._copy(batch.restore_state)
        for row in batch.rows:
            before = () if row.start_pos == 0 else self.state[row.state_slot]
            assert before == tuple(row.context[: row.start_pos]), (
                f"{row.request_id}: slot {row.state_slot} holds the state after {len(before)} tokens "
                f"(or other tokens), its row starts at {row.start_pos}"
            )
            self.state[row.state_slot] = before + row.token_ids
            self.chunks.setdefault(row.request_id, []).append((row.start_pos, row.end_pos))
        out = self.inner.execute(batch)
        self._copy(batch.snapshot_state)
        return out


def make(
    snapshots: int = 16,
    pages: int = 4096,
    budget: int = 64,
    seqs: int = 8,
    *,
    async_scheduling: bool = False,
    device: Callable[[StateSim], ModelRunner] | None = None,
) -> tuple[BatchScheduler, StateSim]:
    """A scheduler over the state sim; `device` wraps the sim in the runner the scheduler drives
    (test_async_state.py: a late device under async scheduling)."""
    config = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, async_scheduling=async_scheduling)
    groups = SimOptions(engine=config, num_kv_pages=pages).kv_groups()
    sim = StateSim(SimRunner(groups))
    scheduler = BatchScheduler(
        sim if device is None else device(sim),
        config,
        groups,
        {EOS_TOKEN_ID},
        4096,
        model_id="sim",
        vocab_size=VOCAB_SIZE,
        state_slots=seqs + 1,
        snapshot_slots=snapshots,
    )
    return scheduler, sim


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, VOCAB_SIZE) for _ in range(n))


def serve(scheduler: BatchScheduler, *requests: Request) -> dict[str, tuple[int | None, list[int]]]:
    """Run to idle: per request, (cached_tokens, generated tokens)."""
    for r in requests:
        scheduler.submit(r)
    out: dict[str, tuple[int | None, list[int]]] = {r.request_id: (None, []) for r in requests}
    steps = 0
    while scheduler.has_work():
        for u in scheduler.step().updates:
            cached, got = out[u.request_id]
            out[u.request_id] = (
                u.cached_tokens if u.cached_tokens is not None else cached,
                got + list(u.new_token_ids),
            )
        steps += 1
        assert steps < 10_000
    return out


def cold(prompt: tuple[int, ...], n: int = 4) -> list[int]:
    scheduler, _ = make()
    return serve(scheduler, Request("cold", prompt, greedy(n)))["cold"][1]


def assert_consistent(scheduler: BatchScheduler) -> None:
    """Every snapshot the cache holds is keyed by a page the KV index still holds; none pending."""
    snapshots = scheduler.kv.snapshots
    assert snapshots is not None
    assert snapshots.pending == 0
    for page_hash in snapshots.hashes():
        assert all(g.index.find(page_hash) is not None for g in scheduler.kv.groups)


def test_chunks_end_on_page_boundaries_and_hits_stop_at_the_deepest_snapshot() -> None:
    scheduler, sim = make()
    base = tokens(100, seed=1)
    serve(scheduler, Request("a", base, greedy(4)))
    # 64-token budget: the first chunk ends on a boundary; the last one stops at 96, the deepest
    # boundary a resend can resume from, and the 4-token tail runs alone.
    assert sim.chunks["a"][:3] == [(0, 64), (64, 96), (96, 100)]
    assert scheduler.kv.snapshots is not None and scheduler.kv.snapshots.held == 2

    cases = {
        "resend": (base, 96),
        "extension": (base + tokens(20, seed=2), 96),
        # 80 shared tokens: five cached pages, but the state exists only at 64.
        "mid-chunk": (base[:80] + tokens(30, seed=3), 64),
        # 40 shared tokens: two cached pages and no snapshot at 16 or 32: no hit at all.
        "no-snapshot": (base[:40] + tokens(10, seed=4), 0),
    }
    for name, (prompt, expected) in cases.items():
        cached, got = serve(scheduler, Request(name, prompt, greedy(4)))[name]
        assert cached == expected, f"{name}: cached_tokens={cached}, expected {expected}"
        assert got == cold(prompt), name
        assert sim.chunks[name][0][0] == expected, sim.chunks[name]
    assert_consistent(scheduler)


def test_short_prompts_hit_at_one_page() -> None:
    scheduler, sim = make()
    one = tokens(20, seed=10)
    serve(scheduler, Request("a", one, greedy(3)))
    assert sim.chunks["a"][:2] == [(0, 16), (16, 20)]
    prompt = one[:16] + tokens(5, seed=11)
    cached, got = serve(scheduler, Request("b", prompt, greedy(3)))["b"]
    assert (cached, got) == (16, cold(prompt, 3))

    # Exactly two pages: snapshots at 16 (what a resend resumes from) and at 32 (an extension).
    two = tokens(32, seed=12)
    serve(scheduler, Request("c", two, greedy(3)))
    assert sim.chunks["c"][:2] == [(0, 16), (16, 32)]
    assert serve(scheduler, Request("resend", two, greedy(3)))["resend"][0] == 16
    longer = two + tokens(3, seed=13)
    cached, got = serve(scheduler, Request("ext", longer, greedy(3)))["ext"]
    assert (cached, got) == (32, cold(longer, 3))
    assert_consistent(scheduler)


def test_a_prompt_under_one_page_is_not_cut() -> None:
    scheduler, sim = make()
    serve(scheduler, Request("a", tokens(13, seed=20), greedy(2)))
    assert sim.chunks["a"][0] == (0, 13)
    assert scheduler.kv.snapshots is not None and scheduler.kv.snapshots.held == 0


def test_evicting_a_page_frees_its_snapshot() -> None:
    # 9 usable pages: a 40-token prompt growing by 4 holds 3 and leaves its 2 full ones cached, with
    # a snapshot at 32; later prompts evict them.
    scheduler, _ = make(pages=10)
    first = tokens(40, seed=30)
    serve(scheduler, Request("a", first, greedy(4)))
    snapshots = scheduler.kv.snapshots
    assert snapshots is not None and snapshots.held == 1
    for i in range(6):
        serve(scheduler, Request(f"x{i}", tokens(40, seed=31 + i), greedy(4)))
        assert_consistent(scheduler)
    # 9 pages hold at most 4 such prefixes: a snapshot beyond that outlived its page.
    assert snapshots.held <= 4, "snapshots outlived their evicted pages"
    cached, got = serve(scheduler, Request("again", first, greedy(4)))["again"]
    assert cached == 0 and got == cold(first)
    assert_consistent(scheduler)


def test_a_full_snapshot_pool_costs_hits_never_correctness() -> None:
    scheduler, _ = make(snapshots=1)
    a, b = tokens(40, seed=40), tokens(40, seed=41)
    # Both end their first chunk on page 32 in the same step: one slot, so one snapshot.
    serve(scheduler, Request("a", a, greedy(4)), Request("b", b, greedy(4)))
    snapshots = scheduler.kv.snapshots
    assert snapshots is not None and snapshots.held == 1
    hits = {
        name: serve(scheduler, Request(f"{name}2", prompt, greedy(4)))[f"{name}2"]
        for name, prompt in (("a", a), ("b", b))
    }
    assert sorted(cached for cached, _ in hits.values()) == [0, 32], hits
    assert hits["a"][1] == cold(a) and hits["b"][1] == cold(b)

    # A new prefix takes the only slot from the least recently used snapshot: its pages stay
    # cached, but a hit on them now resumes from nothing.
    c = tokens(40, seed=42)
    before = snapshots.evicted_for_space
    serve(scheduler, Request("c", c, greedy(4)))
    assert snapshots.evicted_for_space == before + 1
    assert serve(scheduler, Request("c2", c, greedy(4)))["c2"][0] == 32
    for name, prompt in (("a", a), ("b", b)):
        cached, got = serve(scheduler, Request(f"{name}3", prompt, greedy(4)))[f"{name}3"]
        assert cached == 0 and got == cold(prompt), name
    assert_consistent(scheduler)


def test_a_failed_step_releases_its_pending_snapshots() -> None:
    scheduler, sim = make()
    scheduler.submit(Request("a", tokens(40, seed=50), greedy(4)))
    sim.fail_next = True
    with pytest.raises(RuntimeError, match="injected"):
        scheduler.step()
    snapshots = scheduler.kv.snapshots
    assert snapshots is not None and snapshots.pending == 1
    scheduler.fail_step("injected step failure")
    assert (snapshots.pending, snapshots.held) == (0, 0)
    assert scheduler.load().state_slots_used == 0 and scheduler.load().kv_pages_used == 0


def test_nothing_leaks_after_many_requests_aborts_and_preemptions() -> None:
    rng = random.Random(60)
    # 11 usable pages for 4 running requests of up to 100 tokens: preemption is frequent.
    scheduler, _ = make(snapshots=6, pages=12, budget=48, seqs=4)
    shared = [tokens(48, seed=61), tokens(24, seed=62)]
    submitted: list[str] = []
    hits = 0
    for i in range(120):
        prefix = shared[rng.randrange(2)][: rng.randrange(0, 49)]
        prompt = prefix + tokens(rng.randrange(1, 40), seed=100 + i)
        rid = f"r{i}"
        scheduler.submit(Request(rid, prompt, greedy(rng.randrange(1, 12))))
        submitted.append(rid)
        for _ in range(rng.randrange(0, 3)):
            if scheduler.has_work():
                hits += sum(bool(u.cached_tokens) for u in scheduler.step().updates)
        if i % 7 == 3:
            scheduler.abort(submitted[rng.randrange(len(submitted))])
        assert scheduler.kv.snapshots is not None and scheduler.kv.snapshots.pending == 0
    while scheduler.has_work():
        hits += sum(bool(u.cached_tokens) for u in scheduler.step().updates)
    assert scheduler.num_preemptions > 0 and hits > 0, (scheduler.num_preemptions, hits)
    load = scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used, load.state_slots_used) == (0, 0, 0, 0), load
    snapshots = scheduler.kv.snapshots
    assert snapshots is not None and 0 < snapshots.held <= snapshots.total
    assert_consistent(scheduler)


def test_a_stateful_scheduler_needs_snapshot_slots_for_prefix_caching() -> None:
    config = EngineConfig(max_num_seqs=4)
    groups = SimOptions(num_kv_pages=64).kv_groups()
    with pytest.raises(ContractError, match="snapshot"):
        BatchScheduler(SimRunner(groups), config, groups, {EOS_TOKEN_ID}, 64, model_id="sim", state_slots=5)
    # Without state the argument changes nothing: a plain model keeps its page-only cache.
    plain = BatchScheduler(SimRunner(groups), config, groups, {EOS_TOKEN_ID}, 64, model_id="sim")
    assert plain.kv.snapshots is None


def test_snapshot_cache_lifetimes() -> None:
    cache = SnapshotCache(range(5, 7))
    a, b = cache.take(), cache.take()
    assert (a, b, cache.take()) == (5, 6, None)  # both pending: nothing to hand out
    assert cache.commit(5, b"h1") and not cache.commit(6, b"h1")  # a duplicate prefix frees its slot
    assert (cache.held, cache.pending, cache.find(b"h1")) == (1, 0, 5)
    with pytest.raises(SnapshotError):
        cache.release(5)  # committed, not pending
    assert cache.take() == 6
    cache.commit(6, b"h2")
    cache.touch(5)  # h1 is now the most recently used
    assert cache.take() == 6 and cache.find(b"h2") is None and cache.evicted_for_space == 1
    cache.release(6)
    cache.forget(b"h1")
    assert (cache.held, cache.find(b"h1")) == (0, None)
    assert sorted(s for s in (cache.take(), cache.take()) if s is not None) == [5, 6]


def test_state_pool_copies_slots_on_the_device() -> None:
    pools = StatePools(
        StateShape(num_layers=2, conv=(3, 4), recurrent=(2, 3, 5)), torch.float32, torch.device("cpu")
    )
    pools.allocate(3, snapshots=2)
    assert (pools.num_slots, pools.running_slots, list(pools.snapshot_ids())) == (5, 3, [3, 4])
    assert pools.conv is not None and pools.recurrent is not None
    pools.conv[:, 1] = torch.randn(2, 3, 4)
    pools.recurrent[:, 1] = torch.randn(2, 2, 3, 5)
    pools.copy_slots([(1, 4), (4, 2)])
    for slot in (2, 4):
        assert torch.equal(pools.conv[:, slot], pools.conv[:, 1])
        assert torch.equal(pools.recurrent[:, slot], pools.recurrent[:, 1])
    assert not pools.recurrent[:, 3].any() and not pools.recurrent[:, 0].any()
    with pytest.raises(ValueError, match="slots must differ"):
        pools.copy_slots([(0, 3)])
    assert PAGE_SIZE == 16  # the chunk arithmetic above assumes 16-token pages


def test_only_the_last_chunk_is_cut() -> None:
    # A 50-token budget ends the first chunk off a boundary (no snapshot there); the last chunk
    # stops at 96, so a resend still resumes from 96.
    scheduler, sim = make(budget=50)
    base = tokens(100, seed=70)
    serve(scheduler, Request("a", base, greedy(2)))
    assert sim.chunks["a"][:3] == [(0, 50), (50, 96), (96, 100)]
    assert serve(scheduler, Request("b", base, greedy(2)))["b"][0] == 96
    assert serve(scheduler, Request("c", base[:60] + tokens(5, seed=71), greedy(2)))["c"][0] == 0
