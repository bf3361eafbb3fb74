"""The two KV groups: sliding pages are released as the window moves, global pages never."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.contract import Request
from engine.kv import KVManager
from gates.gemma4.conftest import NEW_TOKENS, agree, prompt
from gates.harness.serving import Completion, batch_scheduler, drive, greedy, load_for_gate
from gates.harness.tolerances import Tolerance
from kernels.kv_layout import PAGE_SIZE, pages_for
from models.gemma4.config import Gemma4Config
from models.gemma4.model import GROUP_KINDS

SLIDING_GROUP = GROUP_KINDS.index("sliding_attention")
GLOBAL_GROUP = GROUP_KINDS.index("full_attention")


def test_window_release_is_footprint_only(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tol: Tolerance
) -> None:
    """The same request with window release switched off holds more sliding pages and computes the
    same tokens and log-probs."""
    w = gemma4_config.sliding_window
    new_tokens = 2 * w
    target = Request("r", prompt(gemma4_config, 4 * w + 3, seed=101), greedy(new_tokens))
    releasing = load_for_gate(checkpoint_path, max_num_batched_tokens=w)
    keeping = load_for_gate(checkpoint_path, max_num_batched_tokens=w)
    kv_keep = batch_scheduler(keeping).kv
    kv_keep.release_window = lambda request_id, frontier: None  # type: ignore[method-assign]
    peaks = {"release": 0, "keep": 0}

    def peak(label: str, model_kv: KVManager) -> Callable[[int, dict[str, Completion]], None]:
        def watch(step: int, results: dict[str, Completion]) -> None:
            live = model_kv.live_pages("r")
            peaks[label] = max(peaks[label], live[SLIDING_GROUP])

        return watch

    released = drive(releasing, [target], after_step=peak("release", batch_scheduler(releasing).kv))["r"]
    kept = drive(keeping, [target], after_step=peak("keep", kv_keep))["r"]
    assert peaks["release"] < peaks["keep"], f"release changed no footprint: {peaks}"
    agree("window release vs none", released, kept, tol, new_tokens)
    assert [lp.logprob for lp in released.logprobs] == [lp.logprob for lp in kept.logprobs] or tol.tie > 0, (
        "fp32: releasing out-of-window pages must not move a single log-prob"
    )


def test_chunked_prefill_leaves_headroom(checkpoint_path: Path, gemma4_config: Gemma4Config) -> None:
    """A long prompt prefilled in chunks of C never holds more sliding pages than a window plus a
    chunk touch, while its global pages grow with the whole context."""
    w = gemma4_config.sliding_window
    chunk = max(1, w // 2)
    length = 6 * w + 5
    served = load_for_gate(checkpoint_path, max_num_batched_tokens=chunk)
    kv = batch_scheduler(served).kv
    spec = kv.groups[SLIDING_GROUP].spec
    bound = spec.max_live_pages(length + 4, chunk)
    seen: list[tuple[int, int]] = []

    def watch(step: int, results: dict[str, Completion]) -> None:
        live = kv.live_pages("r")
        seen.append((live[SLIDING_GROUP], live[GLOBAL_GROUP]))
        load = served.scheduler.load()
        by_name = {g.name: g.pages_used for g in load.groups}
        assert by_name == {
            GROUP_KINDS[SLIDING_GROUP]: live[SLIDING_GROUP],
            GROUP_KINDS[GLOBAL_GROUP]: live[GLOBAL_GROUP],
        }, f"step {step}: load() per group {by_name} differs from the request's pages {live}"

    drive(served, [Request("r", prompt(gemma4_config, length, seed=111), greedy(4))], after_step=watch)
    worst = max(s for s, _ in seen)
    assert worst <= bound, f"the sliding group held {worst} pages, over window + chunk = {bound}"
    assert max(g for _, g in seen) >= pages_for(length), f"global pages never covered the prompt: {seen}"
    assert worst < max(g for _, g in seen), "the sliding group released nothing"


def test_prefix_restore_matches_cold(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tol: Tolerance
) -> None:
    """A shared prefix several windows long: the second request hits every full shared page (the
    sliding group restores only the pages its window still reads) and computes the cold path's
    tokens and log-probs."""
    w = gemma4_config.sliding_window
    page = PAGE_SIZE
    shared = prompt(gemma4_config, 3 * w + 20, seed=51)
    first = Request("first", shared + prompt(gemma4_config, 7, seed=52), greedy(4))
    second = Request("second", shared + prompt(gemma4_config, 9, seed=53), greedy(NEW_TOKENS))
    cold = drive(load_for_gate(checkpoint_path), [second])["second"]
    served = load_for_gate(checkpoint_path)
    drive(served, [first])
    warm = drive(served, [second])["second"]
    assert cold.cached_tokens == 0, f"a cold start reported {cold.cached_tokens} cached tokens"
    want = page * (len(shared) // page)
    assert want > w and warm.cached_tokens == want, (
        f"cached_tokens={warm.cached_tokens}, expected {want} (W={w})"
    )
    agree("prefix hit vs cold", warm, cold, tol)
    if tol.tie == 0 or tol.baseline_ratio is None:
        assert warm.tokens == cold.tokens
