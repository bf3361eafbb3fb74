"""Scheduling must not change what a request computes: chunking, neighbours, order, prefix hits."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Request
from gates.harness.compare import assert_streams_agree
from gates.harness.serving import Completion, drive, greedy, load_for_gate, random_prompt
from gates.harness.tolerances import Tolerance
from gates.qwen3.conftest import prompt_lengths
from models.qwen3.config import Qwen3Config

NEW_TOKENS = 16


def _agree(name: str, a: Completion, b: Completion, tol: Tolerance) -> None:
    assert len(a.tokens) == len(b.tokens) == NEW_TOKENS, f"{name}: {len(a.tokens)} and {len(b.tokens)} tokens"
    assert_streams_agree(name, a.tokens, a.logprobs, b.tokens, b.logprobs, tol.stream_logprob, tol.tie)


def test_chunked_prefill_matches_whole(
    checkpoint_path: Path, qwen3_config: Qwen3Config, tol: Tolerance
) -> None:
    length = max(prompt_lengths())
    prompt = random_prompt(length, seed=21, vocab_size=qwen3_config.vocab_size)
    request = Request("r", prompt, greedy(NEW_TOKENS))
    whole = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=length + 8), [request])["r"]
    for chunk in (1, 15, 16, 17):
        chunked = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=chunk), [request])["r"]
        _agree(f"chunk {chunk}", chunked, whole, tol)


def test_mixed_step_matches_serial(checkpoint_path: Path, qwen3_config: Qwen3Config, tol: Tolerance) -> None:
    """A request prefilled beside live decodes computes what it computes alone."""
    lengths = prompt_lengths()
    target = Request(
        "target", random_prompt(lengths[-1], seed=31, vocab_size=qwen3_config.vocab_size), greedy(NEW_TOKENS)
    )
    alone = drive(load_for_gate(checkpoint_path), [target])["target"]
    neighbours = [
        Request(
            f"n{i}", random_prompt(n, seed=40 + i, vocab_size=qwen3_config.vocab_size), greedy(4 * NEW_TOKENS)
        )
        for i, n in enumerate(lengths[:2])
    ]
    mixed_steps: list[int] = []

    def watch(step: int, results: dict[str, Completion]) -> None:
        got = results.get("target")
        if got is not None and got.admission is not None and not mixed_steps:
            decoding = [
                r
                for r in neighbours
                if results[r.request_id].tokens and results[r.request_id].terminal is None
            ]
            if decoding:
                mixed_steps.append(step)

    beside = drive(load_for_gate(checkpoint_path), neighbours, arrivals={3: [target]}, after_step=watch)[
        "target"
    ]
    assert mixed_steps, "the target was never prefilled in a step with live decodes: the gate tested nothing"
    _agree("mixed vs serial", beside, alone, tol)


def test_prefix_restore_matches_cold(
    checkpoint_path: Path, qwen3_config: Qwen3Config, tol: Tolerance
) -> None:
    shared = random_prompt(48, seed=51, vocab_size=qwen3_config.vocab_size)
    first = Request(
        "first", shared + random_prompt(7, seed=52, vocab_size=qwen3_config.vocab_size), greedy(4)
    )
    second = Request(
        "second", shared + random_prompt(9, seed=53, vocab_size=qwen3_config.vocab_size), greedy(NEW_TOKENS)
    )
    cold = drive(load_for_gate(checkpoint_path), [second])["second"]
    served = load_for_gate(checkpoint_path)
    drive(served, [first])
    warm = drive(served, [second])["second"]
    assert cold.cached_tokens == 0, f"a cold start reported {cold.cached_tokens} cached tokens"
    assert warm.cached_tokens is not None and warm.cached_tokens >= 32, (
        f"no prefix hit: cached_tokens={warm.cached_tokens}"
    )
    _agree("prefix hit vs cold", warm, cold, tol)


def test_batch_row_order_does_not_matter(
    checkpoint_path: Path, qwen3_config: Qwen3Config, tol: Tolerance
) -> None:
    requests = [
        Request(
            f"r{i}", random_prompt(n, seed=60 + i, vocab_size=qwen3_config.vocab_size), greedy(NEW_TOKENS)
        )
        for i, n in enumerate((*prompt_lengths(), 5))
    ]
    forward = drive(load_for_gate(checkpoint_path), requests)
    backward = drive(load_for_gate(checkpoint_path), list(reversed(requests)))
    for request in requests:
        rid = request.request_id
        _agree(f"{rid} forward vs reversed", forward[rid], backward[rid], tol)
