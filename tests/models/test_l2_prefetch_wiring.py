"""Every model line asks for each mixer's output projection weight in L2 once a forward, with the
step's token count, between the prep and the attention (or before the GDN mixer): the L2 prefetch
of docs/kernels.md, "L2 prefetch of the output projection". Off CUDA the request launches nothing;
here it is only recorded, beside the order of attention calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.contract import Request, SamplingParams
from engine.scheduler import BatchScheduler
from kernels import layer_ops
from models.registry import ModelOptions, load_model

LINES = ("tiny_qwen3", "tiny_qwen35", "tiny_gemma4", "tiny_gemma3")
PROMPTS = ((40, 41, 42, 43, 44), (50, 51, 52))


def _output_weights(model: Any) -> list[int]:
    """Each layer's output projection after its mixer (O, or a GDN layer's out_proj), in order."""
    found = []
    for layer in model.layers:
        mixer = getattr(layer, "mixer", layer)
        found.append((mixer.out if hasattr(mixer, "in_proj") else mixer.o).data_ptr())
    return found


@pytest.mark.parametrize("line", LINES)
def test_each_layer_prefetches_its_output_projection_once_a_forward(
    line: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint: Path = request.getfixturevalue(line)
    engine = EngineConfig(max_num_batched_tokens=64, num_kv_pages=32, max_num_seqs=2, enforce_eager=True)
    options = ModelOptions(engine=engine, device="cpu", dtype="float32", attention_backend="torch")
    scheduler = load_model(str(checkpoint), options).scheduler
    assert isinstance(scheduler, BatchScheduler)
    model = scheduler.runner.model  # type: ignore[attr-defined]
    events: list[tuple[str, int, int]] = []

    def record(weight: torch.Tensor, rows: int) -> None:
        events.append(("prefetch", weight.data_ptr(), rows))

    monkeypatch.setattr(layer_ops, "prefetch_weight", record)
    forward = model.forward

    def counted(batch: Any) -> torch.Tensor:
        events.append(("forward", 0, int(batch.input_ids.shape[0])))
        return forward(batch)

    monkeypatch.setattr(model, "forward", counted)
    for i, prompt in enumerate(PROMPTS):
        scheduler.submit(Request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0)))
    while scheduler.has_work():
        scheduler.step()

    expected = _output_weights(model)
    forwards = [i for i, event in enumerate(events) if event[0] == "forward"]
    assert len(forwards) >= 4
    for start, end in zip(forwards, [*forwards[1:], len(events)], strict=True):
        tokens = events[start][2]
        assert events[start + 1 : end] == [("prefetch", ptr, tokens) for ptr in expected], line
