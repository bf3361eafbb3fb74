"""A raised context ceiling: past the config's max_position_embeddings only with the opt-in.

The default ceiling is the text config's `max_position_embeddings` (D). With
`allow_long_max_model_len` the model serves up to a raised `max_model_len`: RoPE past D is the same
formula (transformers computes it for any position, so it is the reference there too), the KV tables
cover the extra pages, and the scheduler still refuses what crosses the raised limit. Without the
opt-in the same `max_model_len` is refused at load, before any weight or page exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.contract import Finished, FinishReason, Rejected, RejectReason, Request, TokenLogprob
from gates.gemma4.conftest import prompt
from gates.harness.checkpoint_view import with_text_config
from gates.harness.compare import assert_parity, assert_streams_agree, logprob_delta
from gates.harness.hf_reference import hf_logprobs
from gates.harness.serving import Completion, drive, greedy, load_for_gate, score
from gates.harness.tolerances import Tolerance
from kernels.kv_layout import PAGE_SIZE, pages_for
from models.gemma4.config import Gemma4Config, parse_gemma4_config
from models.registry import ModelLoadError

PAGE = PAGE_SIZE
# How far past D the ceiling is raised, and how far the served request reaches across D.
EXTRA_PAGES = 4
BEFORE_DEFAULT = 8
# A real checkpoint's D (262144 for Gemma 4) would make transformers score a quarter-million tokens;
# the rule does not depend on D's value, so such a checkpoint is viewed with this lower ceiling.
LARGEST_TESTED_CEILING = 4096


@pytest.fixture()
def ceiling_view(
    checkpoint_path: Path, gemma4_config: Gemma4Config, tmp_path: Path
) -> tuple[Path, Gemma4Config]:
    """The checkpoint, with max_position_embeddings lowered to LARGEST_TESTED_CEILING if above it."""
    if gemma4_config.max_position_embeddings <= LARGEST_TESTED_CEILING:
        return checkpoint_path, gemma4_config
    view = with_text_config(
        checkpoint_path, tmp_path / "view", max_position_embeddings=LARGEST_TESTED_CEILING
    )
    return view, parse_gemma4_config(view)


def _raised(config: Gemma4Config) -> int:
    return config.max_position_embeddings + EXTRA_PAGES * PAGE


def _kv_pages(max_model_len: int) -> int:
    """Enough global pages for one request at the raised ceiling (plus page 0 and slack), whatever
    D is: the gates' fixed pool (512 pages on CPU) would not hold a real checkpoint's D."""
    return pages_for(max_model_len) + 8


def _greedy_pick(row: torch.Tensor) -> TokenLogprob:
    """What a greedy step would report from one row of log-probs: its argmax and the top five."""
    top = row.topk(5)
    pairs = tuple((int(t), float(v)) for t, v in zip(top.indices, top.values, strict=True))
    return TokenLogprob(pairs[0][0], pairs[0][1], pairs)


def test_raised_ceiling_serves_past_default(
    ceiling_view: tuple[Path, Gemma4Config], hf: Any, hf_fp32: Any, tol: Tolerance
) -> None:
    checkpoint_path, gemma4_config = ceiling_view
    default = gemma4_config.max_position_embeddings
    raised = _raised(gemma4_config)
    served = load_for_gate(
        checkpoint_path,
        max_model_len=raised,
        allow_long_max_model_len=True,
        num_kv_pages=_kv_pages(raised),
    )
    assert served.max_model_len == raised
    # Starts before D and ends past it: decode steps write and read KV at positions >= D.
    prompt_len = default - BEFORE_DEFAULT
    new_tokens = BEFORE_DEFAULT + 2 * PAGE
    assert prompt_len + new_tokens <= raised
    across = Request("across", prompt(gemma4_config, prompt_len, seed=600), greedy(new_tokens))
    over = Request("over", prompt(gemma4_config, raised - 3, seed=601), greedy(4))
    results = drive(served, [across, over])

    got: Completion = results["across"]
    assert got.terminal == Finished(FinishReason.LENGTH, prompt_len, new_tokens), got.terminal
    assert len(got.tokens) == new_tokens == len(got.logprobs)
    terminal = results["over"].terminal
    assert isinstance(terminal, Rejected) and terminal.reason is RejectReason.CONTEXT_LENGTH, terminal
    assert results["over"].tokens == [] and results["over"].admission is None

    # Teacher-forced over the whole sequence; compared from one page before D to the end.
    tokens = list(across.prompt_token_ids) + got.tokens
    candidate = score(served, tokens)
    reference = hf_logprobs(hf_fp32, tokens)
    start = default - PAGE
    tail = tokens[start:]
    delta = logprob_delta(candidate[start:], reference[start:], tail)
    baseline = (
        None if hf is hf_fp32 else logprob_delta(hf_logprobs(hf, tokens)[start:], reference[start:], tail)
    )
    print(
        f"positions {start}..{len(tokens) - 2} (D = {default}, max_model_len = {raised}):", delta.describe()
    )
    assert_parity(delta, baseline, tol)

    # The served stream's own log-probs past D are the teacher-forced ones (same picks, same values).
    # Row i of `forced` sees exactly the context the served stream had when it picked token i.
    forced = [_greedy_pick(row) for row in candidate[prompt_len - 1 : len(tokens) - 1]]
    assert_streams_agree(
        "served decode vs teacher-forced past D",
        got.tokens,
        got.logprobs,
        [lp.token_id for lp in forced],
        forced,
        tol.stream_logprob,
        tol.tie,
    )


def test_raised_ceiling_refuses_without_prerequisites(
    ceiling_view: tuple[Path, Gemma4Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint_path, gemma4_config = ceiling_view
    default = gemma4_config.max_position_embeddings
    raised = _raised(gemma4_config)

    # The refusal must come before any weight, KV page or engine is built: reaching these fails it.
    def too_late(*args: object, **kwargs: object) -> None:
        raise AssertionError("the load got past the context-ceiling check")

    monkeypatch.setattr("models.paged_line.load_checked", too_late)
    monkeypatch.setattr("models.paged_line.start_paged_model", too_late)
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    with pytest.raises(ModelLoadError) as info:
        load_for_gate(checkpoint_path, max_model_len=raised, num_kv_pages=_kv_pages(raised))
    message = str(info.value)
    print(message)
    assert f"max_model_len = {raised}" in message, message
    assert f"max_position_embeddings (text config) = {default}" in message, message
    if torch.cuda.is_available():
        assert torch.cuda.memory_allocated() == before, "the refused load left device memory behind"
