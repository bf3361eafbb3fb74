"""transformers as the reference: same checkpoint, teacher-forced log-probs and greedy generate."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def hf_model(checkpoint: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' model of the checkpoint at `dtype`, exactly as `from_pretrained(dtype=dtype)`
    builds it: parameters in `dtype`, buffers as transformers makes them (RoPE's inv_freq stays
    float32 in a bf16 model).

    Only fp32 is reached another way: loaded as stored, moved, and widened on the device, so that a
    bf16 checkpoint is not widened on the host first (48 GB of host work for a 12B model). Widening
    is exact, so that gives the same model. Narrowing is not done so: `.to(bfloat16)` also rounds
    the float32 buffers: with inv_freq in bf16, Qwen3-4B's RoPE angles are off by up to 0.8 rad at
    position 700 (the H200 run at 3a1aa3d, where the Qwen3 greedy gate's transformers stream
    parted from infer's at token 0 of its 700-token prompt, ran such a reference)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    stored_or_wanted: Any = "auto" if dtype == torch.float32 else dtype
    model: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=stored_or_wanted)
    model = model.to(device)
    if dtype == torch.float32:
        model = model.float()
    return model.eval()


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
