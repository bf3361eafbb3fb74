"""Scheduling must not change what a request computes: serving, chunking, neighbours, order."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Request
from gates.gemma4.conftest import NEW_TOKENS, agree, prompt, prompt_lengths, request
from gates.harness.serving import Completion, batch_scheduler, drive, greedy, load_for_gate, score
from gates.harness.tolerances import Tolerance
from kernels.kv_layout import PAGE_SIZE, ceil_div, pages_for
from models.gemma4.config import Gemma4Config


def test_serve_matches_full_forward(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tol: Tolerance
) -> None:
    """Every served token's log-prob (chunked prefill, then decode past the window) equals the
    log-prob one teacher-forced prefill of prompt + output gives it. The decode runs
    min(W + 4, three pages + 4) tokens: the window slides across page boundaries during decode,
    each releasing a page, on any checkpoint. On a real one (W = 1024) a thousand more decode steps
    would test nothing new and turn the bound into a maximum over a thousand tokens, not dozens."""
    w = gemma4_config.sliding_window
    length = max(prompt_lengths(gemma4_config))
    new_tokens = min(w + 4, 3 * PAGE_SIZE + 4)
    target = Request("r", prompt(gemma4_config, length, seed=11), greedy(new_tokens))
    served = load_for_gate(checkpoint_path, max_num_batched_tokens=w + 3)
    got = drive(served, [target])["r"]
    whole = score(load_for_gate(checkpoint_path), list(target.prompt_token_ids) + got.tokens)
    rows = [whole[length + i - 1] for i in range(len(got.tokens))]
    gaps = [
        abs(lp.logprob - float(row[t])) for row, t, lp in zip(rows, got.tokens, got.logprobs, strict=True)
    ]
    regrets = [float(row.max() - row[t]) for row, t in zip(rows, got.tokens, strict=True)]
    print(
        f"{len(gaps)} served tokens: |Δ log-prob| mean {sum(gaps) / len(gaps):.3g}, max {max(gaps):.3g}; "
        f"max regret {max(regrets):.3g} (bounds {tol.stream_logprob}, tie {tol.tie})"
    )
    for i, (token, lp) in enumerate(zip(got.tokens, got.logprobs, strict=True)):
        assert regrets[i] <= tol.tie, f"token {i}: {token} costs the full forward {regrets[i]:.3g}"
        assert gaps[i] <= tol.stream_logprob, (
            f"token {i}: served {lp.logprob:.6g} vs full forward {float(rows[i][token]):.6g}"
        )


def test_chunked_prefill_matches_whole(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tol: Tolerance
) -> None:
    """Chunks of 1, a page ± 1 and W ± 1 tokens. The small chunks run over a prompt just past the
    window (W + 5: one chunk crosses it), the W ± 1 chunks over one several windows long, so no
    chunk size costs thousands of steps on a real-dimension checkpoint."""
    w = gemma4_config.sliding_window
    short, long = prompt_lengths(gemma4_config)[1], max(prompt_lengths(gemma4_config))
    for length, chunks in ((short, {1, 15, 17}), (long, {w - 1, w + 1})):
        target = request(gemma4_config, "r", length, seed=21)
        whole = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=length + 8), [target])["r"]
        for chunk in sorted(chunks):
            chunked = drive(load_for_gate(checkpoint_path, max_num_batched_tokens=chunk), [target])["r"]
            agree(f"chunk {chunk} over {length} tokens (W={w})", chunked, whole, tol)


def test_mixed_step_matches_serial(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tol: Tolerance
) -> None:
    """A prompt longer than the window, prefilled in chunks beside live decodes, computes what it
    computes alone; every one of its prefill steps carries decodes, so the chunk that crosses the
    window does too."""
    w = gemma4_config.sliding_window
    lengths = prompt_lengths(gemma4_config)
    target = request(gemma4_config, "target", lengths[-1], seed=31)
    neighbours = [
        request(gemma4_config, f"n{i}", n, seed=40 + i, new_tokens=8 * NEW_TOKENS)
        for i, n in enumerate(lengths[:2])
    ]
    # Two decode rows plus a chunk of half a window: the target's prefill needs several steps.
    budget = len(neighbours) + max(1, w // 2)
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
        arrivals={6: [target]},
        after_step=watch,
    )["target"]
    assert len(prefill_steps) >= 2, (
        f"the target prefilled in {len(prefill_steps)} step(s): nothing crossed the window in a mixed step"
    )
    assert all(prefill_steps), (
        f"some prefill steps of the target had no live decode beside them: {prefill_steps}"
    )
    agree("mixed vs serial", beside, alone, tol)


def test_batch_row_order_does_not_matter(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tol: Tolerance
) -> None:
    requests = [
        request(gemma4_config, f"r{i}", n, seed=60 + i)
        for i, n in enumerate((*prompt_lengths(gemma4_config), 5))
    ]
    forward = drive(load_for_gate(checkpoint_path), requests)
    backward = drive(load_for_gate(checkpoint_path), list(reversed(requests)))
    for r in requests:
        agree(f"{r.request_id} forward vs reversed", forward[r.request_id], backward[r.request_id], tol)


def test_segmented_admission_matches_whole(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tol: Tolerance
) -> None:
    """A long prompt admitted into a tight pool, with pages for its first chunk only, grows (or is
    preempted and re-admitted) segment by segment as a neighbour's decode competes for pages, and
    computes what one whole admission into a roomy pool computes."""
    w = gemma4_config.sliding_window
    budget = max(2, w // 2)
    target = request(gemma4_config, "target", 5 * w + 3, seed=121)
    whole_pages = pages_for(len(target.prompt_token_ids))
    neighbour = request(gemma4_config, "n", 6 * w + 40, seed=122, new_tokens=2 * w)
    prefilled = pages_for(len(neighbour.prompt_token_ids))
    # Once the neighbour's prompt is in, fewer pages are free than the target's prompt needs; the
    # neighbour's decode then needs more, which it may take back from the (newer) target.
    pool = prefilled + whole_pages - 1
    arrival = ceil_div(len(neighbour.prompt_token_ids), budget) + 2
    whole = drive(
        load_for_gate(checkpoint_path, max_num_batched_tokens=4 * len(target.prompt_token_ids)), [target]
    )
    tight = load_for_gate(checkpoint_path, num_kv_pages=pool + 1, max_num_batched_tokens=budget)
    free_before: list[int] = []
    at_admission: list[int] = []

    def watch(step: int, results: dict[str, Completion]) -> None:
        got = results.get("target")
        if got is not None and got.admission is not None and not at_admission:
            at_admission.append(free_before[-1])
        groups = {g.name: g for g in tight.scheduler.load().groups}
        full = groups["full_attention"]
        free_before.append(full.pages_total - full.pages_used)

    segmented = drive(tight, [neighbour], arrivals={arrival: [target]}, after_step=watch)
    assert at_admission and at_admission[0] < whole_pages, (
        f"the target was admitted with {at_admission} free global pages, enough for its whole prompt "
        f"({whole_pages}): nothing was segmented"
    )
    print(
        f"free global pages at admission {at_admission[0]} of {whole_pages} needed; "
        f"preemptions {batch_scheduler(tight).num_preemptions}"
    )
    agree("segmented vs whole admission", segmented["target"], whole["target"], tol)
