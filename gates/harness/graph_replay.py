"""The CUDA-graph gate every model suite runs: replay against the same padded step run eagerly."""

from __future__ import annotations

from pathlib import Path

from engine.contract import Request
from gates.harness.compare import assert_streams_agree
from gates.harness.serving import drive, greedy, load_for_gate, paged_runner, random_prompt
from gates.harness.tolerances import Tolerance


def _workload(vocab_size: int) -> list[Request]:
    """17 requests decode together (bucket 24), then 5 of them alone (bucket 8)."""
    return [
        Request(
            f"r{i}", random_prompt(9 + 3 * i, seed=90 + i, vocab_size=vocab_size), greedy(6 if i < 12 else 14)
        )
        for i in range(17)
    ]


def check_graph_replay_matches_eager(checkpoint_path: Path, vocab_size: int, tol: Tolerance) -> None:
    """Decode graphs at bucket straddles (5→8, 17→24) replay bit-identically to the same padded
    step run eagerly, and agree with unpadded eager decode within the dtype's stream tolerance; with
    prefill graphs on (`infer gates --prefill-graphs`), the prefill and mixed steps too."""
    requests = _workload(vocab_size)
    graphed = load_for_gate(checkpoint_path, max_num_seqs=32)
    padded_eager = load_for_gate(checkpoint_path, max_num_seqs=32)
    paged_runner(padded_eager).replay_graphs = False
    unpadded = load_for_gate(checkpoint_path, max_num_seqs=32, enforce_eager=True)

    replayed = drive(graphed, requests)
    eager = drive(padded_eager, requests)
    plain = drive(unpadded, requests)

    graphs = paged_runner(graphed).graphs
    assert graphs is not None, "the model started without CUDA graphs"
    for bucket in (8, 24):
        assert graphs.steps_per_bucket[bucket] > 0, (
            f"no decode step ran in bucket {bucket}: {graphs.steps_per_bucket}"
        )
    assert paged_runner(unpadded).graphs is None
    # Under `infer gates --prefill-graphs` the prompts' prefill and mixed steps replay those too.
    prefill = paged_runner(graphed).prefill_graphs
    if prefill is not None:
        assert sum(prefill.replays_per_bucket.values()) > 0, (
            f"no prefill or mixed step replayed a prefill graph: {prefill.steps_per_bucket}"
        )
    for request in requests:
        rid = request.request_id
        a, b = replayed[rid], eager[rid]
        assert a.tokens == b.tokens, f"{rid}: replay {a.tokens} vs eager {b.tokens}"
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs], (
            f"{rid}: log-probs differ"
        )
        c = plain[rid]
        assert_streams_agree(
            f"{rid} graph vs unpadded eager",
            a.tokens,
            a.logprobs,
            c.tokens,
            c.logprobs,
            tol.stream_logprob,
            tol.tie,
        )
