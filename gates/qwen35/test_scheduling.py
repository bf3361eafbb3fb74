"""Scheduling must not change what a request computes: chunk boundaries anywhere (the recurrent
state carried across them), neighbours in the step, row order, preemption and recompute."""

from __future__ import annotations

from pathlib import Path

from gates.harness.preemption import check_preemption_recompute_matches
from gates.harness.scheduling import (
    check_chunked_prefill_matches_whole,
    check_mixed_step_matches_serial,
    check_row_order_does_not_matter,
)
from gates.harness.serving import Completion
from gates.harness.tolerances import Tolerance
from gates.qwen35.conftest import prompt_lengths
from models.qwen35.config import Qwen35Config
from models.registry import LoadedModel

# One boundary at 500 (neither on a 64-token GDN chunk nor on a 16-token page), 5 tokens before
# the prompt's end: close enough that a state dropped there shows in the log-probs. On the tiny
# checkpoint, marking every row fresh moves them by 2.4e-3 here (bound 1e-4); with the boundary
# 533 tokens before the end it moved them by 6e-5 only, as its GDN decays forget within tokens.
LONG_CHUNK = 500
LONG_PROMPT = LONG_CHUNK + 5


def test_chunked_prefill_matches_whole(
    checkpoint_path: Path, qwen35_config: Qwen35Config, tol: Tolerance
) -> None:
    """Chunks of 1, 7 and 63/64/65 (either side of the 64-token GDN chunk and on it) put the
    boundary where the conv and recurrent state must be carried exactly; a chunk of 500 (on every
    tier) puts it inside a GDN chunk deep into a long prompt."""
    for length, chunks in ((max(prompt_lengths()), (1, 7, 63, 64, 65)), (LONG_PROMPT, (LONG_CHUNK,))):
        check_chunked_prefill_matches_whole(checkpoint_path, qwen35_config.vocab_size, tol, length, chunks)


def test_mixed_step_matches_serial(
    checkpoint_path: Path, qwen35_config: Qwen35Config, tol: Tolerance
) -> None:
    """A request prefilled beside live decodes computes what it computes alone."""
    check_mixed_step_matches_serial(checkpoint_path, qwen35_config.vocab_size, tol, prompt_lengths())


def test_batch_row_order_does_not_matter(
    checkpoint_path: Path, qwen35_config: Qwen35Config, tol: Tolerance
) -> None:
    check_row_order_does_not_matter(checkpoint_path, qwen35_config.vocab_size, tol, prompt_lengths())


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
