"""Numeric parity with transformers on the same checkpoint, across the sliding window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.contract import Request
from gates.gemma3.conftest import NEW_TOKENS, prompt, prompt_lengths
from gates.harness.compare import assert_full_forward_parity, first_divergence
from gates.harness.hf_reference import hf_greedy, hf_logprobs
from gates.harness.serving import drive, greedy, score
from gates.harness.tolerances import Tolerance
from models.gemma3.config import Gemma3Config
from models.registry import LoadedModel


def test_full_forward_matches_hf(
    served: LoadedModel,
    hf: Any,
    hf_fp32: Any,
    checkpoint_path: Path,
    gemma3_config: Gemma3Config,
    tol: Tolerance,
) -> None:
    """Teacher-forced log-probs over a prompt past the window, against transformers in fp32."""
    tokens = prompt(checkpoint_path, gemma3_config, max(prompt_lengths(gemma3_config)), seed=1)
    baseline = None if hf is hf_fp32 else hf_logprobs(hf, tokens)
    assert_full_forward_parity(score(served, tokens), hf_logprobs(hf_fp32, tokens), baseline, tokens, tol)


def test_greedy_matches_hf_generate(
    served: LoadedModel, hf: Any, checkpoint_path: Path, gemma3_config: Gemma3Config, tol: Tolerance
) -> None:
    """Prompts inside and past the window; decoding carries the first across it. Token-identical
    on fp32; on bf16 the streams may part only at a reference near-tie."""
    new_tokens = NEW_TOKENS + 8  # a W-3 prompt and 24 tokens cross W at any window size
    for i, length in enumerate(prompt_lengths(gemma3_config)):
        tokens = prompt(checkpoint_path, gemma3_config, length, seed=10 + i)
        got = drive(served, [Request(f"g{i}", tokens, greedy(new_tokens))])[f"g{i}"]
        want = hf_greedy(hf, tokens, new_tokens)
        assert len(got.tokens) == new_tokens, f"prompt {i}: infer produced {len(got.tokens)} tokens"
        part = first_divergence(got.tokens, want)
        print(f"prompt {i} ({length} tokens): " + ("identical" if part is None else f"parts at token {part}"))
        if part is None:
            continue
        assert tol.tie > 0, f"prompt {i}: infer {got.tokens} vs transformers {want} (fp32 must be identical)"
        ref = hf_logprobs(hf, list(tokens) + got.tokens[: part + 1])[length + part - 1]
        regret = float(ref.max() - ref[got.tokens[part]])
        print(f"  infer's token there costs the reference {regret:.3g} (tie bound {tol.tie})")
        assert regret <= tol.tie, (
            f"prompt {i}: streams part at token {part} where infer's choice costs the reference {regret:.3g} "
            f"> {tol.tie} (infer {got.tokens}, transformers {want})"
        )
