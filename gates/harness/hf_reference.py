"""transformers as the reference: same checkpoint, teacher-forced log-probs and greedy generate."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def hf_model(checkpoint: Path, device: torch.device, dtype: torch.dtype) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    # Loaded as stored, moved, then cast on the device: a bf16 checkpoint wanted in fp32 is not
    # widened on the host first (48 GB of host work for a 12B model; the values are the same).
    model: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype="auto")
    return model.to(device).to(dtype).eval()


@torch.inference_mode()
def hf_logprobs(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """Float32 log-probs [n, vocab] at every position, on the host: a 12B model's vocabulary makes
    each such tensor gigabytes, and a gate holds several while the models stay on the device."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([list(token_ids)], device=device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    device = next(model.parameters()).device
    out = model.generate(
        torch.tensor([list(prompt)], device=device),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt) :].tolist()]
