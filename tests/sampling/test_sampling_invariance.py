"""Seeded sampling is a function of the row alone: bit-identical tokens and log-probs whatever
the batch size, the row's position, its neighbours, the plan, or graph padding."""

from __future__ import annotations

import random

import pytest
import torch
from sampler_testkit import run_sampler, same_params_rows

from engine.contract import SamplingParams
from engine.runner import BatchRow
from engine.sampling import SamplerOutput, sample
from engine.sampling_batch import RowSampling, SamplingBatch, SamplingPlan, SeedSource

TARGETS = [
    SamplingParams(temperature=1.0, seed=1, logprobs=3),
    SamplingParams(temperature=0.7, top_p=0.9, seed=2, logprobs=0),
    SamplingParams(temperature=1.3, top_k=40, seed=3),
    SamplingParams(temperature=0.9, min_p=0.05, seed=-4, logprobs=5),
    SamplingParams(temperature=1.1, top_k=100, top_p=0.8, min_p=0.01, seed=2**70 + 5, logprobs=1),
    SamplingParams(temperature=0.0, seed=6, logprobs=2),
]
NEIGHBOURS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.5, top_p=0.3, logprobs=20),
    SamplingParams(temperature=2.0, top_k=3),
    SamplingParams(temperature=1.0, min_p=0.5, logprobs=7),
]


def _row_result(output: SamplerOutput, row: int, num_top: int | None) -> tuple[torch.Tensor, ...]:
    parts = [output.token_ids[row]]
    if num_top is not None:
        assert output.logprobs is not None
        parts.append(output.logprobs[row])
        if num_top:
            assert output.top_ids is not None and output.top_logprobs is not None
            parts += [output.top_ids[row, :num_top], output.top_logprobs[row, :num_top]]
    return tuple(part.cpu() for part in parts)


def _assert_bitwise(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == want.dtype
        # Bit patterns, so that -0.0 vs 0.0 or a last-ulp difference would fail too.
        got_bits = got.view(torch.int32) if got.dtype == torch.float32 else got
        want_bits = want.view(torch.int32) if want.dtype == torch.float32 else want
        assert torch.equal(got_bits, want_bits)


@pytest.mark.parametrize("vocab", [1001, 4096])
def test_rows_are_bit_identical_alone_and_in_any_batch(device: str, vocab: int) -> None:
    generator = torch.Generator().manual_seed(10)
    target_logits = torch.randn(len(TARGETS), vocab, generator=generator) * 3
    neighbour_logits = torch.randn(len(NEIGHBOURS), vocab, generator=generator) * 3
    seeds = SeedSource(key=b"invariance-test!")
    steps = [0, 5, 17, 1, 2**31, 3]

    def entry(kind: str, index: int) -> tuple[RowSampling, torch.Tensor]:
        if kind == "target":
            params = TARGETS[index]
            return RowSampling(params, seeds.seed_for(f"t{index}", params), steps[index]), target_logits[
                index
            ]
        params = NEIGHBOURS[index]
        return RowSampling(params, seeds.seed_for(f"n{index}", params), index), neighbour_logits[index]

    def run(layout: list[tuple[str, int]]) -> SamplerOutput:
        rows, logits = zip(*(entry(kind, i) for kind, i in layout), strict=True)
        return run_sampler(torch.stack(logits).to(device), rows)

    alone = {i: _row_result(run([("target", i)]), 0, TARGETS[i].logprobs) for i in range(len(TARGETS))}

    shuffler = random.Random(3)
    layouts: list[list[tuple[str, int]]] = []
    everything = [("target", i) for i in range(len(TARGETS))] + [
        ("neighbour", i) for i in range(len(NEIGHBOURS))
    ]
    layouts.append(everything)
    layouts.append(everything[::-1])
    for _ in range(6):
        layout = everything * shuffler.randint(1, 3)
        shuffler.shuffle(layout)
        layouts.append(layout[: shuffler.randint(len(TARGETS), len(layout))])
    for layout in layouts:
        output = run(layout)
        for position, (kind, i) in enumerate(layout):
            if kind == "target":
                _assert_bitwise(_row_result(output, position, TARGETS[i].logprobs), alone[i])


def test_seeded_stream_is_the_same_in_any_batch(device: str) -> None:
    """A seeded request's whole stream, decoded alone and decoded beside changing neighbours."""
    generator = torch.Generator().manual_seed(11)
    steps, vocab = 12, 500
    stream_logits = torch.randn(steps, vocab, generator=generator) * 2
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, logprobs=2)

    alone = run_sampler(stream_logits.to(device), same_params_rows(params, steps, seed=1234))
    for step in range(steps):
        neighbours = step % 4
        logits = torch.cat(
            [torch.randn(neighbours, vocab, generator=generator), stream_logits[step : step + 1]]
        )
        rows = [RowSampling(SamplingParams(temperature=1.0, top_k=5), seed=99, step=step)] * neighbours
        batched = run_sampler(logits.to(device), [*rows, RowSampling(params, 1234, step)])
        _assert_bitwise(_row_result(batched, neighbours, 2), _row_result(alone, step, 2))


def test_plan_shortcuts_do_not_change_results(device: str) -> None:
    """Eager steps skip the sort (no row filters), min-p (no row sets it) or the noise (all greedy);
    rows that need none of them must come out the same bits as under the full graph plan."""
    generator = torch.Generator().manual_seed(12)
    logits = (torch.randn(6, 800, generator=generator) * 3).to(device)
    unfiltered = [
        RowSampling(SamplingParams(temperature=0.9, min_p=0.02, logprobs=4), i, i) for i in range(6)
    ]
    no_min_p = [RowSampling(SamplingParams(temperature=1.2, top_p=0.9, logprobs=4), i, i) for i in range(6)]
    greedy = [RowSampling(SamplingParams(temperature=0.0, logprobs=4), i, i) for i in range(6)]
    full = SamplingPlan.widest(num_logprobs=20)
    for rows, shortcut in (
        (unfiltered, "sorted_filters"),
        (no_min_p, "min_p_filter"),
        (greedy, "random_rows"),
    ):
        batch = SamplingBatch.pack(rows)
        assert getattr(batch.plan, shortcut) is False
        params = batch.to(device)
        eager, graphed = sample(logits, params, batch.plan), sample(logits, params, full)
        for row in range(6):
            _assert_bitwise(_row_result(eager, row, 4), _row_result(graphed, row, 4))


def test_different_seeds_give_different_streams(device: str) -> None:
    logits = torch.zeros(200, 1000, device=device)  # uniform: only the noise decides
    streams = {
        seed: run_sampler(logits, same_params_rows(SamplingParams(seed=seed), 200, seed=seed)).token_ids
        for seed in (1, 2, 2**40 + 1, -1)
    }
    values = list(streams.values())
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            assert float((values[i] == values[j]).double().mean()) < 0.05
    # Within one stream, steps differ too (200 draws from 1000 tokens: a few repeats at most).
    assert len(set(streams[1].tolist())) > 150


def test_seeds_are_taken_modulo_2_64(device: str) -> None:
    logits = torch.zeros(50, 1000, device=device)

    def stream(seed: int) -> list[int]:
        return run_sampler(logits, same_params_rows(SamplingParams(), 50, seed=seed)).token_ids.tolist()

    assert stream(7) == stream(7 + 2**64)
    assert stream(-1) == stream(2**64 - 1)
    assert stream(7) != stream(8)


def test_seed_source_is_stable_per_request_and_random_across_sources() -> None:
    source = SeedSource(key=b"k" * 16)
    unseeded = SamplingParams()
    assert source.seed_for("req-1", unseeded) == source.seed_for("req-1", unseeded)
    assert source.seed_for("req-1", unseeded) != source.seed_for("req-2", unseeded)
    assert SeedSource().seed_for("req-1", unseeded) != SeedSource().seed_for("req-1", unseeded)
    assert source.seed_for("req-1", SamplingParams(seed=42)) == 42

    row = BatchRow(
        request_id="req-1",
        token_ids=(5,),
        start_pos=9,
        page_tables=((1,),),
        sample=True,
        sampling=unseeded,
        context=(1, 2, 3, 4, 5, 6, 7, 8, 9, 5),
        num_generated=3,
    )
    assert RowSampling.of(row, source) == RowSampling(unseeded, source.seed_for("req-1", unseeded), 3)


def test_greedy_rows_take_no_seed() -> None:
    # Greedy rows never read the noise, so their seed is not derived (and is 0).
    greedy = SamplingParams(temperature=0.0)
    row = BatchRow(
        request_id="req-1",
        token_ids=(5,),
        start_pos=9,
        page_tables=((1,),),
        sample=True,
        sampling=greedy,
        context=(1, 2, 3, 4, 5, 6, 7, 8, 9, 5),
        num_generated=3,
    )
    assert RowSampling.of(row, SeedSource()) == RowSampling(greedy, 0, 3)
