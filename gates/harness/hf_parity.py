"""Parity gates against transformers any suite can run on a served model and its HF reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.contract import Request
from gates.harness.compare import assert_full_forward_parity, first_divergence
from gates.harness.hf_reference import hf_greedy, hf_logprobs
from gates.harness.serving import drive, greedy, random_prompt, score
from gates.harness.tolerances import Tolerance
from models.registry import LoadedModel


def check_full_forward_matches_hf(
    served: LoadedModel, hf: Any, hf_fp32: Any, vocab_size: int, length: int, tol: Tolerance
) -> None:
    """Teacher-forced log-probs against fp32 transformers; on bf16, transformers at the serving
    dtype gives the baseline error the bound is set from."""
    tokens = random_prompt(length, seed=1, vocab_size=vocab_size)
    baseline = None if hf is hf_fp32 else hf_logprobs(hf, tokens)
    assert_full_forward_parity(score(served, tokens), hf_logprobs(hf_fp32, tokens), baseline, tokens, tol)


def check_greedy_matches_hf_generate(
    served: LoadedModel,
    hf: Any,
    vocab_size: int,
    lengths: Sequence[int],
    tol: Tolerance,
    new_tokens: int = 24,
) -> None:
    """Token-identical on fp32; on bf16 the streams may part only where the reference itself is at a
    near-tie (infer's token within `tol.tie` of the reference's best), and are not compared after."""
    for i, length in enumerate(lengths):
        prompt = random_prompt(length, seed=10 + i, vocab_size=vocab_size)
        got = drive(served, [Request(f"g{i}", prompt, greedy(new_tokens))])[f"g{i}"]
        want = hf_greedy(hf, prompt, new_tokens)
        assert len(got.tokens) == new_tokens, f"prompt {i}: infer produced {len(got.tokens)} tokens"
        part = first_divergence(got.tokens, want)
        if part is None:
            continue
        assert tol.tie > 0, f"prompt {i}: infer {got.tokens} vs transformers {want} (fp32 must be identical)"
        ref = hf_logprobs(hf, list(prompt) + got.tokens[: part + 1])[len(prompt) + part - 1]
        regret = float(ref.max() - ref[got.tokens[part]])
        assert regret <= tol.tie, (
            f"prompt {i}: streams part at token {part} where infer's choice costs the reference {regret:.3g} "
            f"> {tol.tie} (infer {got.tokens}, transformers {want})"
        )
