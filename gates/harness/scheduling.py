"""Scheduling gates any paged suite can run: chunk boundaries, neighbours in a step and row order
must not change what a request computes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.contract import Request
from gates.harness.compare import assert_streams_agree
from gates.harness.serving import Completion, drive, greedy, load_for_gate, random_prompt
from gates.harness.tolerances import Tolerance

NEW_TOKENS = 16


def assert_completions_agree(name: str, a: Completion, b: Completion, tol: Tolerance) -> None:
    assert len(a.tokens) == len(b.tokens) == NEW_TOKENS, f"{name}: {len(a.tokens)} and {len(b.tokens)} tokens"
    assert_streams_agree(name, a.tokens, a.logprobs, b.tokens, b.logprobs, tol.stream_logprob, tol.tie)


def check_chunked_prefill_matches_whole(
    checkpoint_path: Path, vocab_size: int, tol: Tolerance, length: int, chunks: Sequence[int]
) -> None:
    """A `length`-token prompt prefilled in chunks of each size computes what it computes whole."""
    prompt = random_prompt(length, seed=21, vocab_size=vocab_size)
    request = Request("r", prompt, greedy(NEW_TOKENS))
    whole = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=length + 8), [request])["r"]
    for chunk in chunks:
        assert chunk < length, f"a {chunk}-token chunk of a {length}-token prompt splits nothing"
        chunked = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=chunk), [request])["r"]
        assert_completions_agree(f"chunk {chunk} of {length}", chunked, whole, tol)


def check_mixed_step_matches_serial(
    checkpoint_path: Path, vocab_size: int, tol: Tolerance, lengths: Sequence[int]
) -> None:
    """A request prefilled beside live decodes computes what it computes alone."""
    target = Request("target", random_prompt(lengths[-1], seed=31, vocab_size=vocab_size), greedy(NEW_TOKENS))
    alone = drive(load_for_gate(checkpoint_path), [target])["target"]
    neighbours = [
        Request(f"n{i}", random_prompt(n, seed=40 + i, vocab_size=vocab_size), greedy(4 * NEW_TOKENS))
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
    assert_completions_agree("mixed vs serial", beside, alone, tol)


def check_row_order_does_not_matter(
    checkpoint_path: Path, vocab_size: int, tol: Tolerance, lengths: Sequence[int]
) -> None:
    """One batch submitted forwards and reversed: every request computes the same."""
    requests = [
        Request(f"r{i}", random_prompt(n, seed=60 + i, vocab_size=vocab_size), greedy(NEW_TOKENS))
        for i, n in enumerate((*lengths, 5))
    ]
    forward = drive(load_for_gate(checkpoint_path), requests)
    backward = drive(load_for_gate(checkpoint_path), list(reversed(requests)))
    for request in requests:
        rid = request.request_id
        assert_completions_agree(f"{rid} forward vs reversed", forward[rid], backward[rid], tol)
