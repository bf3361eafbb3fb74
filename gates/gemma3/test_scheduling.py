"""Scheduling must not change what a request computes: chunking and neighbours."""

from __future__ import annotations

from pathlib import Path

from gates.gemma3.conftest import agree, prompt_lengths, request
from gates.harness.serving import Completion, drive, load_for_gate
from gates.harness.tolerances import Tolerance
from kernels.kv_layout import PAGE_SIZE, ceil_div
from models.gemma3.config import Gemma3Config

CHUNKED_NEW_TOKENS = 4
# The target arrives before this step, once the neighbours' prompts are in and they decode.
ARRIVAL_STEP = 6


def test_chunked_prefill_matches_whole(
    checkpoint_path: Path, gemma3_config: Gemma3Config, tol: Tolerance
) -> None:
    """Chunks of 1 token over a prompt of two pages and a bit (past the window on the tiny
    checkpoint), of a page ± 1 over one just past the window (one chunk crosses it), and of W ± 1
    over the longest prompt, each against one whole prefill of the same prompt. A few decode
    tokens follow: they read back what the chunks wrote (on real weights each step costs a
    forward of 268 M parameters, so a long decode here would test nothing new, slowly)."""
    w = gemma3_config.sliding_window
    _, short, long = prompt_lengths(gemma3_config)
    cases = ((2 * PAGE_SIZE + 3, {1}), (short, {PAGE_SIZE - 1, PAGE_SIZE + 1}), (long, {w - 1, w + 1}))
    for length, chunks in cases:
        target = request(checkpoint_path, gemma3_config, "r", length, seed=21, new_tokens=CHUNKED_NEW_TOKENS)
        whole = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=length + 8), [target])["r"]
        for chunk in sorted(chunks):
            chunked = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=chunk), [target])["r"]
            agree(f"chunk {chunk} over {length} tokens (W={w})", chunked, whole, tol, CHUNKED_NEW_TOKENS)


def test_mixed_step_matches_serial(
    checkpoint_path: Path, gemma3_config: Gemma3Config, tol: Tolerance
) -> None:
    """A prompt longer than the window, prefilled in chunks beside live decodes, computes what it
    computes alone; every one of its prefill steps carries decodes, the window-crossing one too."""
    w = gemma3_config.sliding_window
    lengths = prompt_lengths(gemma3_config)
    target = request(checkpoint_path, gemma3_config, "target", lengths[-1], seed=31)
    # Two decode rows plus a chunk of half a window: the target's prefill needs several steps, and
    # the neighbours decode through all of them (and four more).
    chunk = max(1, w // 2)
    budget = 2 + chunk
    neighbour_tokens = ARRIVAL_STEP + ceil_div(lengths[-1], chunk) + 4
    neighbours = [
        request(checkpoint_path, gemma3_config, f"n{i}", 9 + 5 * i, seed=40 + i, new_tokens=neighbour_tokens)
        for i in range(2)
    ]
    alone = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=budget), [target])["target"]
    counts: dict[str, int] = {}
    prefill_steps: list[bool] = []

    def watch(step: int, results: dict[str, Completion]) -> None:
        got = results.get("target")
        before = dict(counts)
        counts.update({rid: len(c.tokens) for rid, c in results.items()})
        if got is None or got.admission is None or before.get("target", 0) > 0:
            return
        decoded = [
            n.request_id
            for n in neighbours
            if before.get(n.request_id, 0) > 0 and counts[n.request_id] > before[n.request_id]
        ]
        prefill_steps.append(bool(decoded))

    beside = drive(
        load_for_gate(checkpoint_path, max_num_batched_tokens=budget),
        neighbours,
        arrivals={ARRIVAL_STEP: [target]},
        after_step=watch,
    )["target"]
    assert len(prefill_steps) >= 2, f"the target prefilled in {len(prefill_steps)} step(s)"
    assert all(prefill_steps), (
        f"some prefill steps of the target had no live decode beside them: {prefill_steps}"
    )
    agree("mixed vs serial", beside, alone, tol)
