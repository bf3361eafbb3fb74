"""Lifecycle at the model level: cancellation frees pages in both KV groups at once."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Finished, FinishReason
from gates.gemma3.conftest import request
from gates.harness.serving import Completion, drive, load_for_gate
from models.gemma3.config import Gemma3Config

# Past the abort at step 4, a few more steps for the others.
NEW_TOKENS = 12


def test_cancel_frees_pages_and_stops_tokens(checkpoint_path: Path, gemma3_config: Gemma3Config) -> None:
    """Three requests past the window decode together; aborting one mid-decode frees pages of every
    group at once, no token of it arrives after the abort, it ends with no terminal, the others
    finish, and no page stays in use."""
    w = gemma3_config.sliding_window
    served = load_for_gate(checkpoint_path)
    requests = [
        request(checkpoint_path, gemma3_config, f"r{i}", w + 9 + 9 * i, seed=70 + i, new_tokens=NEW_TOKENS)
        for i in range(3)
    ]
    seen_at_abort: dict[str, int] = {}

    def cancel_one(step: int, results: dict[str, Completion]) -> None:
        if step == 4:
            before = {g.name: g.pages_used for g in served.scheduler.load().groups}
            seen_at_abort["r1"] = len(results["r1"].tokens)
            served.scheduler.abort("r1")
            after = {g.name: g.pages_used for g in served.scheduler.load().groups}
            for name in before:
                assert after[name] < before[name], f"aborting r1 freed no {name} page: {before} -> {after}"

    results = drive(served, requests, after_step=cancel_one)
    assert seen_at_abort, "the abort never happened"
    assert seen_at_abort["r1"] > 0, "r1 was aborted before it decoded: the abort did not hit a live decode"
    assert len(results["r1"].tokens) == seen_at_abort["r1"], "tokens arrived after the abort"
    assert results["r1"].terminal is None, "an aborted request must retire silently"
    for i in (0, 2):
        assert results[f"r{i}"].terminal == Finished(
            FinishReason.LENGTH, len(requests[i].prompt_token_ids), NEW_TOKENS
        )
    load = served.scheduler.load()
    assert (load.running, load.waiting, load.kv_pages_used) == (0, 0, 0), load
    assert all(g.pages_used == 0 for g in load.groups), load.groups
