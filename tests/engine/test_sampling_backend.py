"""`--sampling-backend`: the token draw of sampled rows through the Triton kernel (under the
interpreter here) or the spec's torch ops (the default), chosen once per engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.contract import ContractError, Request, SamplingParams
from engine.scheduler import BatchScheduler
from models.registry import ModelOptions, load_model


def _sampled_tokens(checkpoint: Path, backend: str) -> tuple[bool, dict[str, list[int]]]:
    engine = EngineConfig(max_num_seqs=4, num_kv_pages=64, sampling_backend=backend)
    scheduler = load_model(str(checkpoint), ModelOptions(engine=engine, device="cpu")).scheduler
    assert isinstance(scheduler, BatchScheduler)
    for i, (temperature, min_p) in enumerate(((0.8, 0.0), (1.3, 0.05), (0.0, 0.0))):
        params = SamplingParams(
            max_tokens=8, temperature=temperature, min_p=min_p, seed=100 + i, ignore_eos=True
        )
        scheduler.submit(Request(f"r{i}", tuple(range(30 + i, 42 + i)), params))
    tokens: dict[str, list[int]] = {}
    while scheduler.has_work():
        for update in scheduler.step().updates:
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
    return scheduler.runner.triton_draw, tokens  # type: ignore[attr-defined]


def test_the_triton_draw_reaches_the_runner_and_draws_the_spec_tokens(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kernels.triton.token_draw as draw_module

    launches: list[int] = []
    real = draw_module.token_draw

    def counted(logits: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        launches.append(logits.shape[0])
        return real(logits, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(draw_module, "token_draw", counted)
    spec_flag, spec = _sampled_tokens(tiny_qwen3, "torch")
    assert not launches, "the default backend launched the kernel"
    kernel_flag, kernel = _sampled_tokens(tiny_qwen3, "triton")
    assert (spec_flag, kernel_flag) == (False, True)
    assert launches, "the triton backend never launched the kernel"
    # Seeded draws: the kernel computes the spec's noise bit for bit and its Gumbel values within an
    # ulp or two (tests/kernels/test_token_draw.py measures that), so on these seeds the same tokens.
    assert kernel == spec and all(len(t) == 8 for t in spec.values()), (kernel, spec)


def test_an_unknown_sampling_backend_is_refused_by_name() -> None:
    with pytest.raises(ContractError, match="sampling_backend"):
        EngineConfig(sampling_backend="flashinfer")
