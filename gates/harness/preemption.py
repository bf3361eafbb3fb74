"""The preemption gate any paged suite can run: a request preempted by recompute computes what it
computes uninterrupted.

Two greedy requests share a KV pool too small for both to finish: the older one's decode needs a
page the pool no longer has, so the newer one, already decoding, is preempted (its pages and, on a
recurrent model, its state slot given back), waits, and is recomputed from its first token when it
is readmitted. Both streams must agree with the same request run alone in a roomy pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.contract import Finished, FinishReason, Request
from gates.harness.compare import assert_streams_agree
from gates.harness.serving import Completion, batch_scheduler, drive, greedy, load_for_gate, random_prompt
from gates.harness.tolerances import Tolerance
from kernels.kv_layout import PAGE_SIZE, pages_for
from models.registry import LoadedModel

# The older request holds 3 pages and the newer 2 at admission; both grow by a page per 16 decoded
# tokens, so the pool (8 usable pages) runs out while both decode, well before either finishes.
OLDER_PROMPT, NEWER_PROMPT = 40, 30
NEW_TOKENS = 48
USABLE_PAGES = 8


@dataclass(frozen=True, slots=True)
class PreemptionRun:
    tight: LoadedModel
    results: dict[str, Completion]
    # Tokens the newer request had streamed when it was first preempted.
    streamed_before_preemption: int


def check_preemption_recompute_matches(
    checkpoint_path: Path,
    vocab_size: int,
    tol: Tolerance,
    after_step: Callable[[LoadedModel, int, dict[str, Completion]], None] | None = None,
) -> PreemptionRun:
    """Runs the workload tight and each request alone; fails unless the newer request was preempted
    mid-decode, and unless both streams agree with their solo runs within `tol`. `after_step` sees
    the tight model after every step (a suite checks its own state there)."""
    older = Request("older", random_prompt(OLDER_PROMPT, seed=141, vocab_size=vocab_size), greedy(NEW_TOKENS))
    newer = Request("newer", random_prompt(NEWER_PROMPT, seed=142, vocab_size=vocab_size), greedy(NEW_TOKENS))
    for r in (older, newer):
        alone = pages_for(len(r.prompt_token_ids) + NEW_TOKENS)
        assert alone <= USABLE_PAGES, f"{r.request_id} needs {alone} pages alone: it could never run"
    both = sum(pages_for(len(r.prompt_token_ids) + NEW_TOKENS) for r in (older, newer))
    assert both > USABLE_PAGES, "the pool holds both requests whole: nothing would be preempted"

    solo = {r.request_id: drive(load_for_gate(checkpoint_path), [r])[r.request_id] for r in (older, newer)}
    tight = load_for_gate(
        checkpoint_path, num_kv_pages=USABLE_PAGES + 1, max_num_batched_tokens=4 * PAGE_SIZE
    )
    scheduler = batch_scheduler(tight)
    streamed: list[int] = []

    def watch(step: int, results: dict[str, Completion]) -> None:
        if not streamed and scheduler.num_preemptions > 0:
            streamed.append(len(results["newer"].tokens))
        if after_step is not None:
            after_step(tight, step, results)

    results = drive(tight, [older], arrivals={1: [newer]}, after_step=watch)
    assert streamed, "nothing was preempted: the gate tested no recompute"
    print(
        f"preemptions {scheduler.num_preemptions}; the newer request had streamed {streamed[0]} "
        f"of {NEW_TOKENS} tokens when first preempted"
    )
    assert 0 < streamed[0] < NEW_TOKENS, (
        f"the newer request was preempted after {streamed[0]} of {NEW_TOKENS} tokens: not mid-decode"
    )
    for r in (older, newer):
        rid = r.request_id
        got = results[rid]
        assert got.terminal == Finished(FinishReason.LENGTH, len(r.prompt_token_ids), NEW_TOKENS), (
            rid,
            got.terminal,
        )
        assert_streams_agree(
            f"{rid}: preempted run vs alone",
            got.tokens,
            got.logprobs,
            solo[rid].tokens,
            solo[rid].logprobs,
            tol.stream_logprob,
            tol.tie,
        )
    return PreemptionRun(tight, results, streamed[0])
