"""Overlapped prefill (`--async-prefill`) computes what synchronous prefill computes, really
overlaps, and keeps an aborted prefill's pages until its forward is over.

Prompts sit inside one window, just past it and across several windows, prefilled in chunks of
W + 3 (so side-stream chunks cross the window) while earlier requests decode. On a GPU the side
forward runs on its own CUDA stream and FlashInfer instance; on CPU it runs at launch, and the
scheduler joins it at a later step all the same.
"""

from __future__ import annotations

from pathlib import Path

from engine.contract import Request
from gates.gemma4.conftest import NEW_TOKENS, agree, prompt_lengths, request
from gates.harness.serving import Completion, batch_scheduler, drive, load_for_gate
from gates.harness.tolerances import Tolerance
from kernels.kv_layout import ceil_div
from models.gemma4.config import Gemma4Config
from models.registry import LoadedModel


def _workload(config: Gemma4Config) -> tuple[list[Request], dict[int, list[Request]]]:
    """Two requests start decoding first; the rest arrive while they decode, one every few steps."""
    lengths = prompt_lengths(config)
    first = [
        request(config, f"early{i}", n, seed=300 + i, new_tokens=4 * NEW_TOKENS)
        for i, n in enumerate(lengths[:2])
    ]
    later = [request(config, f"late{i}", n, seed=310 + i) for i, n in enumerate((*lengths, 5))]
    arrivals = {4 + 3 * i: [r] for i, r in enumerate(later)}
    return first, arrivals


def _pages_used(model: LoadedModel) -> dict[str, int]:
    return {g.name: g.pages_used for g in model.scheduler.load().groups}


def test_overlapped_prefill_matches_sync(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tol: Tolerance
) -> None:
    w = gemma4_config.sliding_window
    budget = w + 3
    first, arrivals = _workload(gemma4_config)
    everyone = first + [r for batch in arrivals.values() for r in batch]

    sync = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=budget), first, arrivals=arrivals)

    overlapped = load_for_gate(checkpoint_path, max_num_batched_tokens=budget, async_prefill=True)
    scheduler = batch_scheduler(overlapped)
    counts: dict[str, int] = {}
    beside: list[tuple[str, str]] = []  # (request in flight through a step, request that decoded in it)

    def watch(step: int, results: dict[str, Completion]) -> None:
        before = dict(counts)
        counts.update({rid: len(c.tokens) for rid, c in results.items()})
        # In flight after the step and already launched before it: in flight through the step.
        through = set(scheduler.prefill_in_flight()) & set(in_flight_before)
        decoded = [rid for rid, n in counts.items() if before.get(rid, 0) > 0 and n > before[rid]]
        beside.extend((a, b) for a in sorted(through) for b in decoded if a != b)
        in_flight_before[:] = scheduler.prefill_in_flight()

    in_flight_before: list[str] = []
    got = drive(overlapped, first, arrivals=arrivals, after_step=watch)
    stats = scheduler.prefill_overlap
    print(f"W={w} budget={budget}: {stats}")

    for r in everyone:
        agree(
            f"{r.request_id} ({len(r.prompt_token_ids)} tokens) async vs sync",
            got[r.request_id],
            sync[r.request_id],
            tol,
            r.sampling.max_tokens,
        )
        assert got[r.request_id].terminals_seen == 1
    # Overlap really happened: a request's prefill was in flight through a step in which another
    # request's decode advanced (seen from outside), and the scheduler counted such steps.
    assert beside, f"no decode advanced while a prefill was in flight ({stats})"
    assert stats.overlapped_decode_steps > 0 and stats.launches == stats.joins > 0, stats
    # The longest prompt alone takes this many side forwards, one chunk each.
    chunks = ceil_div(max(len(r.prompt_token_ids) for r in everyone), budget)
    assert stats.launches >= chunks, f"{stats.launches} side forwards, fewer than {chunks} chunks"
    assert all(n == 0 for n in _pages_used(overlapped).values()), _pages_used(overlapped)

    _abort_in_flight_frees_after_completion(checkpoint_path, gemma4_config, tol, budget)


def _abort_in_flight_frees_after_completion(
    checkpoint_path: Path, config: Gemma4Config, tol: Tolerance, budget: int
) -> None:
    """A long request aborted while its prefill is in flight: retired at once (no terminal, no
    token), its pages in both groups held until its forward is joined, then freed; the neighbour
    is untouched and nothing is left in use."""
    lengths = prompt_lengths(config)
    neighbour = request(config, "neighbour", lengths[1], seed=320, new_tokens=4 * NEW_TOKENS)
    doomed = request(config, "doomed", lengths[-1], seed=321)
    alone = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=budget), [neighbour])

    model = load_for_gate(checkpoint_path, max_num_batched_tokens=budget, async_prefill=True)
    scheduler = batch_scheduler(model)
    held: dict[str, int] = {}
    after_abort: list[dict[str, int]] = []
    freed_while_in_flight: list[int] = []
    freed_at: list[int] = []

    def abort_in_flight(step: int, results: dict[str, Completion]) -> None:
        in_flight = "doomed" in scheduler.prefill_in_flight()
        if not held and in_flight:
            held.update(_pages_used(model))
            scheduler.abort("doomed")
            after_abort.append(_pages_used(model))
            return
        if held and not freed_at:
            if scheduler.kv.holds("doomed"):
                return
            freed_at.append(step)
            if in_flight:
                freed_while_in_flight.append(step)

    arrive = {6: [doomed]}
    results = drive(model, [neighbour], arrivals=arrive, after_step=abort_in_flight)
    assert held, "the long request's prefill was never seen in flight"
    assert after_abort[0] == held, f"abort freed pages of an in-flight prefill: {held} -> {after_abort[0]}"
    assert freed_at, "the aborted request's pages were never freed"
    assert not freed_while_in_flight, (
        f"pages freed while the prefill was in flight (step {freed_while_in_flight})"
    )
    assert scheduler.prefill_overlap.deferred_frees == 1, scheduler.prefill_overlap
    assert results["doomed"].terminals_seen == 0 and results["doomed"].tokens == []
    agree(
        "neighbour beside an aborted in-flight prefill",
        results["neighbour"],
        alone["neighbour"],
        tol,
        4 * NEW_TOKENS,
    )
    load = model.scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0), load
    assert all(g.pages_used == 0 for g in load.groups), load.groups
