"""A step plans only after the previous main-stream step's input copies have run.

The attention backends plan on the host into pinned buffers (FlashInfer's plan workspace, the
page-index buffers of `kernels/attention/flashinfer_backend.py`) and queue their copies to the
device on the stream. A synchronous step that samples nothing (a prefill chunk) returns without
the host waiting for the device, so without a wait the next step's plan could rewrite those
buffers while the copies still read them. On the CPU copies are immediate, so the order is what is
held here: each plan after the first comes after a wait on the event recorded right after the
previous step's plan and input copies (docs/engine.md, "Async scheduling").
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from engine import model_runner
from engine.config import EngineConfig
from engine.contract import SamplingParams
from engine.runner import BatchRow, StepBatch
from models.registry import ModelOptions, load_model


class _Recorder:
    """Stands in for `_record_event` (CUDA events) and for the attention backend's `plan`."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self._events = 0

    def record(self, on_cuda: bool) -> Any:
        index, self._events = self._events, self._events + 1
        self.log.append(("record", index))
        recorder = self

        class _Event:
            def synchronize(self) -> None:
                recorder.log.append(("wait", index))

        return _Event()

    def waits_before_every_plan(self) -> bool:
        """Each step's first plan but the first step's follows a wait on the first event recorded
        after the previous step's plans (the test marks where each step starts)."""
        steps: list[list[tuple[str, int]]] = [[]]
        for entry in self.log:
            if entry[0] == "step":
                steps.append([])
            else:
                steps[-1].append(entry)
        steps = [step for step in steps if step]
        for before, step in itertools.pairwise(steps):
            events = [index for kind, index in before if kind == "record"]
            first_plan = step.index(("plan", -1))
            if not events or ("wait", events[0]) not in step[:first_plan]:
                return False
        return len(steps) > 1


@pytest.mark.parametrize("launched", [False, True], ids=["synchronous", "launched"])
def test_a_plan_waits_for_the_previous_steps_input_copies(
    tiny_gemma4: Path, monkeypatch: pytest.MonkeyPatch, launched: bool
) -> None:
    loaded = load_model(str(tiny_gemma4), ModelOptions(engine=EngineConfig(num_kv_pages=16), device="cpu"))
    runner = loaded.scheduler.runner  # type: ignore[attr-defined]
    recorder = _Recorder()
    monkeypatch.setattr(model_runner, "_record_event", recorder.record)
    plan = runner.attention.plan

    def planned(*args: Any, **kwargs: Any) -> Any:
        recorder.log.append(("plan", -1))
        return plan(*args, **kwargs)

    monkeypatch.setattr(runner.attention, "plan", planned)
    groups = len(runner.model.kv.attention_specs)
    prompt = tuple(range(40, 88))
    # Three 16-token chunks of one prompt; only the last samples.
    for chunk in range(3):
        recorder.log.append(("step", chunk))
        start = 16 * chunk
        pages = (tuple(range(1, chunk + 2)),) * groups
        tokens, context = prompt[start : start + 16], prompt[: start + 16]
        row = BatchRow("r", tokens, start, pages, chunk == 2, SamplingParams(), context, 0)
        if launched:
            runner.launch_step(StepBatch((row,)), None).collect()
        else:
            runner.forward(StepBatch((row,)))
    assert sum(what == "plan" for what, _ in recorder.log) >= 3
    assert recorder.waits_before_every_plan(), recorder.log
