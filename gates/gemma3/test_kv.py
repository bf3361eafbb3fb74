"""The two KV groups: sliding pages are released as the window moves, and a prefix hit restores
the cold path exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.contract import Request
from engine.kv import KVManager
from gates.gemma3.conftest import NEW_TOKENS, agree, prompt, prompt_lengths
from gates.harness.serving import Completion, batch_scheduler, drive, greedy, load_for_gate
from gates.harness.tolerances import Tolerance
from kernels.kv_layout import PAGE_SIZE, ceil_div
from models.gemma3.config import SLIDING, Gemma3Config
from models.gemma3.model import group_kinds


def test_window_release_is_footprint_only(
    checkpoint_path: Path, gemma3_config: Gemma3Config, tol: Tolerance
) -> None:
    """The same request with window release switched off holds more sliding pages and computes the
    same tokens and log-probs. Prefill runs in chunks of W over a prompt past the window, then the
    decode runs a page + 4 tokens: the window crosses a page boundary in prefill and in decode."""
    w = gemma3_config.sliding_window
    sliding = group_kinds(gemma3_config).index(SLIDING)
    new_tokens = PAGE_SIZE + 4
    target = Request(
        "r",
        prompt(checkpoint_path, gemma3_config, max(prompt_lengths(gemma3_config)), 101),
        greedy(new_tokens),
    )
    releasing = load_for_gate(checkpoint_path, max_num_batched_tokens=w)
    keeping = load_for_gate(checkpoint_path, max_num_batched_tokens=w)
    kv_keep = batch_scheduler(keeping).kv
    kv_keep.release_window = lambda request_id, frontier: None  # type: ignore[method-assign]
    peaks = {"release": 0, "keep": 0}

    def peak(label: str, model_kv: KVManager) -> Callable[[int, dict[str, Completion]], None]:
        def watch(step: int, results: dict[str, Completion]) -> None:
            peaks[label] = max(peaks[label], model_kv.live_pages("r")[sliding])

        return watch

    released = drive(releasing, [target], after_step=peak("release", batch_scheduler(releasing).kv))["r"]
    kept = drive(keeping, [target], after_step=peak("keep", kv_keep))["r"]
    print(f"peak sliding pages: {peaks}")
    assert peaks["release"] < peaks["keep"], f"release changed no footprint: {peaks}"
    agree("window release vs none", released, kept, tol, new_tokens)
    assert [lp.logprob for lp in released.logprobs] == [lp.logprob for lp in kept.logprobs] or tol.tie > 0, (
        "fp32: releasing out-of-window pages must not move a single log-prob"
    )


def test_prefix_restore_matches_cold(
    checkpoint_path: Path, gemma3_config: Gemma3Config, tol: Tolerance
) -> None:
    """A shared prefix longer than the window: the second request hits every full shared page (the
    sliding group restores only the pages its window still reads) and computes the cold path's
    tokens and log-probs."""
    w = gemma3_config.sliding_window
    # Four tokens past a page boundary: suffixes that happen to share a first token add no page.
    shared_length = PAGE_SIZE * ceil_div(max(prompt_lengths(gemma3_config)), PAGE_SIZE) + 4
    shared = prompt(checkpoint_path, gemma3_config, shared_length, seed=51)
    first = Request("first", shared + prompt(checkpoint_path, gemma3_config, 7, seed=52)[1:], greedy(4))
    second = Request(
        "second", shared + prompt(checkpoint_path, gemma3_config, 9, seed=53)[1:], greedy(NEW_TOKENS)
    )
    cold = drive(load_for_gate(checkpoint_path), [second])["second"]
    served = load_for_gate(checkpoint_path)
    drive(served, [first])
    warm = drive(served, [second])["second"]
    assert cold.cached_tokens == 0, f"a cold start reported {cold.cached_tokens} cached tokens"
    want = PAGE_SIZE * (len(shared) // PAGE_SIZE)
    assert want > w and warm.cached_tokens == want, (
        f"cached_tokens={warm.cached_tokens}, expected {want} (W={w})"
    )
    agree("prefix hit vs cold", warm, cold, tol)
    if tol.baseline_ratio is None:
        assert warm.tokens == cold.tokens
