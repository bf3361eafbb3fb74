"""A tiny Qwen3 decoding with ``--decode-fusion`` (the fused decode GEMV and MMA forced on under the
Triton interpreter) against the same model composing its projections as every other step does: three
sequences (decode steps through the GEMV) and eight (decode steps of 8 rows through the MMA).

Greedy tokens must be the same. Log-probs may differ by what the spec leaves free (the fp32 order of
each projection's sum and of each norm's sum of squares), so the bound is measured in the same run:
the composed model once more with every projection's sum over K reversed (a linear the spec allows,
``tests/kernels/linear_bounds.py``) gives the log-prob spread that reordering alone causes; the
fused model may sit at most 4× that worst spread from the composed one (about the margin the linear
bounds keep over their measured reordering).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import kernels.triton.fused_gemv as fused_module
import kernels.triton.fused_mma as mma_module
import models.paged_line
from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from engine.scheduler import BatchScheduler
from kernels.gemm.projections import FusedDecodeProjections
from models.registry import ModelOptions, load_model

Run = tuple[dict[str, list[int]], dict[str, list[float]]]


# Three sequences (decode steps of 1-3 rows: the fused GEMV) and eight (steps of 5-8 rows: the
# fused MMA); prompt lengths 5-21, so prefill steps stay within 64 rows and fuse as well.
SMALL = (5, 21, 12)
BATCH_8 = (5, 21, 12, 7, 16, 9, 13, 6)


def _decode(checkpoint: Path, *, fusion: bool, lengths: tuple[int, ...] = SMALL) -> Run:
    engine = EngineConfig(max_num_batched_tokens=64, num_kv_pages=64, max_num_seqs=len(lengths))
    options = ModelOptions(engine=engine, device="cpu", decode_fusion=fusion)
    scheduler = load_model(str(checkpoint), options).scheduler
    assert isinstance(scheduler, BatchScheduler)
    model = scheduler.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.projections, FusedDecodeProjections) == fusion
    prompts = [tuple(range(40, 40 + n)) for n in lengths]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0)
        scheduler.submit(Request(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while scheduler.has_work():
        for update in scheduler.step().updates:
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            logprobs.setdefault(update.request_id, []).extend(lp.logprob for lp in update.logprobs or ())
    return tokens, logprobs


def _worst(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    return max(abs(x - y) for key in a for x, y in zip(a[key], b[key], strict=True))


def _counted(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> list[int]:
    """Record the rows of every call to ``module.name`` (the seam looks it up there on each call)."""
    rows_seen: list[int] = []
    real = getattr(module, name)

    def counted(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        return real(x, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(module, name, counted)
    return rows_seen


def _k_reversed(policy: object, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda x, w: F.linear(x.flip(-1), w.flip(-1))


def _check_against_composed(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch, composed: Run, fused: Run, lengths: tuple[int, ...]
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(models.paged_line, "policy_linear", _k_reversed)
        reordered = _decode(tiny_qwen3, fusion=False, lengths=lengths)

    assert fused[0] == composed[0] and all(len(t) == 10 for t in composed[0].values())
    assert reordered[0] == composed[0]
    spread = _worst(reordered[1], composed[1])
    got = _worst(fused[1], composed[1])
    print(f"log-prob |Δ|: fused {got:.3g}, reordered sums {spread:.3g}")
    assert spread > 0, "the reordered sums changed no log-prob: the bound would be zero"
    assert got <= 4 * spread, (got, spread)


def test_fused_decode_gives_the_composed_tokens_within_the_reordering_bound(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    composed = _decode(tiny_qwen3, fusion=False)
    with monkeypatch.context() as patch:
        gemv_rows = _counted(patch, fused_module, "fused_gemv")
        mma_rows = _counted(patch, mma_module, "fused_mma")
        fused = _decode(tiny_qwen3, fusion=True)
    # Decode steps of 3 rows (and fewer as requests finish) ran the GEMV: 4 launches per layer;
    # the prefill steps (5-38 rows) the MMA.
    assert gemv_rows and max(gemv_rows) <= fused_module.MAX_ROWS, gemv_rows
    assert len(gemv_rows) % 4 == 0 and all(m > fused_module.MAX_ROWS for m in mma_rows), mma_rows
    _check_against_composed(tiny_qwen3, monkeypatch, composed, fused, SMALL)


def test_a_batch_of_eight_decodes_through_the_fused_mma(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    composed = _decode(tiny_qwen3, fusion=False, lengths=BATCH_8)
    with monkeypatch.context() as patch:
        mma_rows = _counted(patch, mma_module, "fused_mma")
        fused = _decode(tiny_qwen3, fusion=True, lengths=BATCH_8)
    # Every sequence decodes 10 tokens together: decode steps of 8 rows through the MMA.
    assert mma_rows.count(len(BATCH_8)) >= 4 * 9, sorted(set(mma_rows))
    assert len(mma_rows) % 4 == 0
    _check_against_composed(tiny_qwen3, monkeypatch, composed, fused, BATCH_8)
