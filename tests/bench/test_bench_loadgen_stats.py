"""The load generator's pieces: prompt sizing, per-request TPOT, and the aggregate statistics."""

from __future__ import annotations

import random

import pytest

from infer_cli.bench.loadgen.client import RequestRecord
from infer_cli.bench.loadgen.prompts import PromptSizeError, TokenRate, make_prompts, random_text
from infer_cli.bench.loadgen.server_metrics import ServerCost, parse_totals
from infer_cli.bench.loadgen.sim_steps import measure_decode_steps
from infer_cli.bench.loadgen.stats import Distribution, summarize


def _record(
    ttft: float, e2e: float, tokens: int, gaps: list[float], prompt_tokens: int = 10
) -> RequestRecord:
    return RequestRecord(
        prompt_chars=prompt_tokens,
        success=True,
        prompt_tokens=prompt_tokens,
        output_tokens=tokens,
        ttft=ttft,
        e2e=e2e,
        chunk_gaps=gaps,
    )


def test_random_text_has_the_exact_length_and_repeats_with_the_seed() -> None:
    for n in (1, 2, 9, 100, 1000):
        assert len(random_text(random.Random(1), n)) == n
    assert make_prompts(4, 3, 50) == make_prompts(4, 3, 50)
    assert make_prompts(4, 3, 50) != make_prompts(5, 3, 50)
    assert len(set(make_prompts(4, 10, 50))) == 10


def test_token_rate_inverts_a_linear_tokenizer() -> None:
    # A chat template adds 20 tokens; a byte-level tokenizer makes one token per character.
    rate = TokenRate.from_probes((48, 144), (68, 164))
    assert (rate.per_char, rate.overhead) == (1.0, 20.0)
    assert rate.chars_for(40) == 20
    # A BPE-like tokenizer at a quarter token per character, no overhead.
    assert TokenRate.from_probes((100, 300), (25, 75)).chars_for(128) == 512
    with pytest.raises(PromptSizeError):
        rate.chars_for(15)


def test_tpot_excludes_the_first_token() -> None:
    assert _record(ttft=0.1, e2e=1.1, tokens=11, gaps=[]).tpot == pytest.approx(0.1)
    assert _record(ttft=0.1, e2e=0.1, tokens=1, gaps=[]).tpot is None


def test_distribution_in_milliseconds() -> None:
    dist = Distribution.of([i / 1000 for i in range(1, 101)])
    assert dist.mean == pytest.approx(50.5)
    assert dist.median == pytest.approx(50.5)
    # Linear interpolation between the 99th and 100th values: 99 + 0.01.
    assert dist.p99 == pytest.approx(99.01)


def test_summary_counts_only_successes_and_flags_wrong_lengths() -> None:
    records = [
        _record(ttft=0.1, e2e=0.5, tokens=5, gaps=[0.1, 0.1, 0.1, 0.1]),
        _record(ttft=0.3, e2e=0.7, tokens=5, gaps=[0.2, 0.2]),
        _record(ttft=0.2, e2e=0.4, tokens=3, gaps=[0.1]),
        RequestRecord(prompt_chars=10, error="HTTP 500"),
    ]
    summary = summarize(records, duration_s=2.0, output_len=5)
    assert (summary.completed, summary.failed) == (3, 1)
    assert summary.total_output_tokens == 13
    assert summary.total_input_tokens == 30
    assert summary.output_throughput == pytest.approx(6.5)
    assert summary.request_throughput == pytest.approx(1.5)
    assert summary.total_token_throughput == pytest.approx(21.5)
    assert summary.ttft.mean == pytest.approx(200.0)
    assert summary.tpot.mean == pytest.approx(100.0)
    assert summary.itl.mean == pytest.approx(1000 * 0.9 / 7)
    assert summary.output_len_mismatches == 1
    flat = summary.to_dict()
    assert flat["mean_e2el_ms"] == pytest.approx(1000 * 1.6 / 3)
    assert flat["duration"] == 2.0


def test_server_cost_from_two_scrapes() -> None:
    before = parse_totals(
        "# HELP x\nprocess_cpu_seconds_total 10.5\n"
        'infer:engine_step_duration_seconds_sum{model_name="sim"} 1.0\n'
        'infer:engine_step_duration_seconds_count{model_name="sim"} 100.0\n'
    )
    after = parse_totals(
        "process_cpu_seconds_total 12.5\n"
        'infer:engine_step_duration_seconds_sum{model_name="sim"} 3.0\n'
        'infer:engine_step_duration_seconds_count{model_name="sim"} 1100.0\n'
    )
    cost = ServerCost.between(before, after)
    assert cost.cpu_s == pytest.approx(2.0)
    assert cost.engine_steps == 1000
    assert cost.engine_step_mean_s == pytest.approx(0.002)
    assert ServerCost.between({}, after) == ServerCost(None, None, None)


def test_sim_step_timing_counts_only_full_decode_steps() -> None:
    # All four prompts prefill together in the first step (which also samples each first token);
    # the nine tokens after that come from pure decode steps.
    timing = measure_decode_steps(batch=4, input_len=8, output_len=10)
    assert timing.decode_steps == 9
    assert 0 < timing.median_s < 0.5
    delayed = measure_decode_steps(batch=4, input_len=8, output_len=4, step_delay_s=0.003)
    assert delayed.decode_steps == 3
    assert delayed.mean_s >= 0.003
    assert delayed.per_token_s == pytest.approx(delayed.mean_s / 4)
