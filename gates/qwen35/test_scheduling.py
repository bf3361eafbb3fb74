"""Scheduling must not change what a request computes: chunk boundaries anywhere (the recurrent
state carried across them), neighbours in the step, row order, preemption and recompute."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Request
from gates.harness.compare import assert_streams_agree
from gates.harness.preemption import check_preemption_recompute_matches
from gates.harness.serving import Completion, drive, greedy, load_for_gate, random_prompt
from gates.harness.tolerances import Tolerance
from gates.qwen35.conftest import prompt_lengths
from models.qwen35.config import Qwen35Config
from models.registry import LoadedModel

NEW_TOKENS = 16
# One boundary at 500 (neither on a 64-token GDN chunk nor on a 16-token page), 5 tokens before
# the prompt's end: close enough that a state dropped there shows in the log-probs. On the tiny
# checkpoint, marking every row fresh moves them by 2.4e-3 here (bound 1e-4); with the boundary
# 533 tokens before the end it moved them by 6e-5 only, as its GDN decays forget within tokens.
LONG_CHUNK = 500
LONG_PROMPT = LONG_CHUNK + 5


def _agree(name: str, a: Completion, b: Completion, tol: Tolerance) -> None:
    assert len(a.tokens) == len(b.tokens) == NEW_TOKENS, f"{name}: {len(a.tokens)} and {len(b.tokens)} tokens"
    assert_streams_agree(name, a.tokens, a.logprobs, b.tokens, b.logprobs, tol.stream_logprob, tol.tie)


def test_chunked_prefill_matches_whole(
    checkpoint_path: Path, qwen35_config: Qwen35Config, tol: Tolerance
) -> None:
    """Chunks of 1, 7 and 63/64/65 (either side of the 64-token GDN chunk and on it) put the
    boundary where the conv and recurrent state must be carried exactly; a chunk of 500 (on every
    tier) puts it inside a GDN chunk deep into a long prompt."""
    for length, chunks in ((max(prompt_lengths()), (1, 7, 63, 64, 65)), (LONG_PROMPT, (LONG_CHUNK,))):
        prompt = random_prompt(length, seed=21, vocab_size=qwen35_config.vocab_size)
        request = Request("r", prompt, greedy(NEW_TOKENS))
        whole = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=length + 8), [request])["r"]
        for chunk in chunks:
            assert chunk < length, f"a {chunk}-token chunk of a {length}-token prompt splits nothing"
            chunked = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=chunk), [request])["r"]
            _agree(f"chunk {chunk} of {length}", chunked, whole, tol)


def test_mixed_step_matches_serial(
    checkpoint_path: Path, qwen35_config: Qwen35Config, tol: Tolerance
) -> None:
    """A request prefilled beside live decodes computes what it computes alone."""
    lengths = prompt_lengths()
    target = Request(
        "target", random_prompt(lengths[-1], seed=31, vocab_size=qwen35_config.vocab_size), greedy(NEW_TOKENS)
    )
    alone = drive(load_for_gate(checkpoint_path), [target])["target"]
    neighbours = [
        Request(
            f"n{i}",
            random_prompt(n, seed=40 + i, vocab_size=qwen35_config.vocab_size),
            greedy(4 * NEW_TOKENS),
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


def test_batch_row_order_does_not_matter(
    checkpoint_path: Path, qwen35_config: Qwen35Config, tol: Tolerance
) -> None:
    requests = [
        Request(
            f"r{i}", random_prompt(n, seed=60 + i, vocab_size=qwen35_config.vocab_size), greedy(NEW_TOKENS)
        )
        for i, n in enumerate((*prompt_lengths(), 5))
    ]
    forward = drive(load_for_gate(checkpoint_path), requests)
    backward = drive(load_for_gate(checkpoint_path), list(reversed(requests)))
    for request in requests:
        rid = request.request_id
        _agree(f"{rid} forward vs reversed", forward[rid], backward[rid], tol)


def test_preemption_recompute_matches(
    checkpoint_path: Path, qwen35_config: Qwen35Config, tol: Tolerance
) -> None:
    """Preempted mid-decode, the newer request gives its state slot back with its pages, and its
    recompute starts from zero state (its first token is at position 0 again): the same tokens and
    log-probs as uninterrupted."""
    slots_seen: list[tuple[int, int]] = []

    def slots_follow_running(model: LoadedModel, step: int, results: dict[str, Completion]) -> None:
        load = model.scheduler.load()
        assert load.state_slots_used == load.running, load
        slots_seen.append((load.running, load.waiting))

    run = check_preemption_recompute_matches(
        checkpoint_path, qwen35_config.vocab_size, tol, after_step=slots_follow_running
    )
    assert (1, 1) in slots_seen, "never one running beside one waiting: the preempted request kept its slot"
    load = run.tight.scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used, load.state_slots_used) == (0, 0, 0, 0), load
