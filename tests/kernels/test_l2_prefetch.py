"""The L2 prefetch (``kernels.triton.l2_prefetch``): its pieces cover a weight exactly, it builds for
sm_90 with the bulk prefetch and both PDL instructions, it refuses what the instruction cannot take,
and every model line asks for each attention layer's O projection once per step, with the same
tokens and log-probs as without it (on a GPU the kernel runs; elsewhere it is a no-op and only the
asking is checked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kernels.triton.l2_prefetch as prefetch_module
from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from engine.scheduler import BatchScheduler
from kernels.gemm.projections import ComposedProjections, FusedDecodeProjections, policy_projections
from kernels.triton.l2_prefetch import ALIGN, L2PrefetchError, PrefetchLayout, prefetch_to_l2
from models.registry import ModelOptions, load_model
from tests.kernels.sm90_compile import compiled_variants

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", [PrefetchLayout(), PrefetchLayout(programs_per_sm=2, pieces=32)])
@pytest.mark.parametrize("sms", [1, 7, 132])
@pytest.mark.parametrize("nbytes", [16, 48, 4096, 2560 * 4096 * 2, 151936 * 2560 * 2, 10_000_016])
def test_pieces_cover_the_bytes_once(layout: PrefetchLayout, sms: int, nbytes: int) -> None:
    programs, piece = layout.pieces_of(nbytes, sms)
    assert piece % ALIGN == 0 and piece > 0
    assert 1 <= programs <= layout.programs_per_sm * sms
    # Every byte lies in some program's pieces, and the last program holds at least one live piece.
    assert programs * layout.pieces * piece >= nbytes
    assert (programs - 1) * layout.pieces * piece < nbytes


def test_refuses_what_the_instruction_cannot_take() -> None:
    weight = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(L2PrefetchError, match="contiguous"):
        prefetch_to_l2(weight.t())
    with pytest.raises(L2PrefetchError, match="aligned"):
        prefetch_to_l2(weight.reshape(-1)[1:])


def test_builds_for_sm90() -> None:
    assert compiled_variants("kernels.triton.l2_prefetch") == ["compiled l2 prefetch pieces=128"]


def test_policy_projections_carry_the_switch() -> None:
    device = torch.device("cpu")
    for policy in ("tuned", "invariant"):
        for fusion in (False, True):
            chosen = policy_projections(
                policy, device, torch.nn.functional.linear, decode_fusion=fusion, l2_prefetch=True
            )
            assert isinstance(chosen, ComposedProjections) and chosen.l2_prefetch
    assert not policy_projections(
        "tuned", device, torch.nn.functional.linear, decode_fusion=False
    ).l2_prefetch
    assert not FusedDecodeProjections(torch.nn.functional.linear).l2_prefetch


def _decode(
    checkpoint: Path, *, l2_prefetch: bool
) -> tuple[dict[str, list[int]], dict[str, list[float]], object]:
    engine = EngineConfig(max_num_batched_tokens=64, num_kv_pages=64, max_num_seqs=3, enforce_eager=True)
    options = ModelOptions(
        engine=engine, device=DEVICE, dtype="float32", attention_backend="torch", l2_prefetch=l2_prefetch
    )
    scheduler = load_model(str(checkpoint), options).scheduler
    assert isinstance(scheduler, BatchScheduler)
    for i, length in enumerate((5, 21, 12)):
        scheduler.submit(
            Request(
                f"r{i}",
                tuple(range(40, 40 + length)),
                SamplingParams(max_tokens=6, temperature=0.0, logprobs=0),
            )
        )
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while scheduler.has_work():
        for update in scheduler.step().updates:
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            logprobs.setdefault(update.request_id, []).extend(lp.logprob for lp in update.logprobs or ())
    return tokens, logprobs, scheduler.runner.model  # type: ignore[attr-defined]


def _o_weights(model: Any) -> list[int]:
    """The O projection of every attention layer, in layer order (Qwen3.5's GDN layers have none)."""
    layers = [getattr(layer, "mixer", layer) for layer in model.layers]
    return [layer.o.data_ptr() for layer in layers if hasattr(layer, "o")]


@pytest.mark.parametrize("line", ["tiny_qwen3", "tiny_qwen35", "tiny_gemma4", "tiny_gemma3"])
def test_each_line_asks_for_its_o_projections_and_keeps_its_values(
    line: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint: Path = request.getfixturevalue(line)
    asked: list[int] = []
    launched: list[int] = []
    real_prefetch = ComposedProjections.prefetch
    real_launch = prefetch_module.prefetch_to_l2

    def spy_prefetch(self: ComposedProjections, weight: torch.Tensor) -> None:
        asked.append(weight.data_ptr())
        real_prefetch(self, weight)

    def spy_launch(weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        launched.append(weight.data_ptr())
        real_launch(weight, *args, **kwargs)

    monkeypatch.setattr(ComposedProjections, "prefetch", spy_prefetch)
    monkeypatch.setattr(prefetch_module, "prefetch_to_l2", spy_launch)
    plain_tokens, plain_logprobs, _ = _decode(checkpoint, l2_prefetch=False)
    asks_without = len(asked)
    assert not launched
    tokens, logprobs, model = _decode(checkpoint, l2_prefetch=True)
    o_weights = _o_weights(model)
    asked_with = asked[asks_without:]
    # One ask per attention layer per step, in layer order, for that layer's O weight.
    assert o_weights and asked_with and len(asked_with) % len(o_weights) == 0
    assert asked_with == o_weights * (len(asked_with) // len(o_weights))
    assert launched == (asked_with if DEVICE == "cuda" else [])
    assert tokens == plain_tokens
    assert logprobs == plain_logprobs  # the prefetch reads and writes no tensor: the same bits
