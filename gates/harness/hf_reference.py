"""transformers as the reference: same checkpoint, teacher-forced log-probs and greedy generate.

The references keep a home device but need not all sit on it at once: before one runs it is made
resident, parking the other references on that device on the host when the device is short
(docs/gates.md, "transformers references"). The served model is never parked: it is no reference."""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

HOST = torch.device("cpu")
# One forward's working memory beyond its logits: a layer's activations at the gates' longest
# prompts (Gemma 4 12B at 3k tokens in fp32: MLP intermediates 3 x 3079 x 15360 x 4 B = 0.57 GB,
# eager attention scores 16 x 3079^2 x 4 B = 0.61 GB) and cuBLAS workspaces, rounded up.
WORKING_MARGIN_BYTES = 2 << 30
# Full-size fp32 copies of the logits a forward holds at its peak: the logits, Gemma's softcap
# temporary, the fp32 copy and log_softmax's output.
LOGITS_COPIES = 4


class DeviceMemory(Protocol):
    def free_bytes(self, device: torch.device) -> int | None:
        """Free bytes on `device` now, or None for a device residency does not budget (the host)."""


@dataclass(frozen=True, slots=True)
class CudaMemory:
    def free_bytes(self, device: torch.device) -> int | None:
        if device.type != "cuda":
            return None
        gc.collect()
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])


CUDA_MEMORY = CudaMemory()


@dataclass(slots=True)
class _Residency:
    home: torch.device
    parked: bool = False


# Weakly keyed: a reference the gates drop leaves the registry with it.
_REFERENCES: weakref.WeakKeyDictionary[Any, _Residency] = weakref.WeakKeyDictionary()


def model_bytes(model: Any) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def is_parked(model: Any) -> bool:
    residency = _REFERENCES.get(model)
    return residency is not None and residency.parked


def forward_headroom(model: Any, n_tokens: int) -> int:
    """Working bytes of a forward over `n_tokens`: its fp32 logits a few times over, plus a margin."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return LOGITS_COPIES * n_tokens * vocab * 4 + WORKING_MARGIN_BYTES


def _move(model: Any, device: torch.device) -> None:
    # In place, and outside inference mode even when a forward's caller is in it: a move made there
    # would leave inference tensors as the model's parameters.
    with torch.inference_mode(False):
        model.to(device)


def make_room(device: torch.device, need: int, keep: Any = None, memory: DeviceMemory = CUDA_MEMORY) -> bool:
    """Park references resident on `device` (other than `keep`) on the host, one at a time, until
    `need` bytes are free there; whether they are. True at once on a device not budgeted."""
    free = memory.free_bytes(device)
    others = [m for m, r in list(_REFERENCES.items()) if m is not keep and r.home == device and not r.parked]
    while free is not None and free < need and others:
        victim = others.pop(0)
        print(
            f"parking a transformers reference ({model_bytes(victim) / 1e9:.1f} GB) on the host: "
            f"{free / 1e9:.1f} GB free on {device}, {need / 1e9:.1f} GB needed"
        )
        _move(victim, HOST)
        _REFERENCES[victim].parked = True
        del victim
        free = memory.free_bytes(device)
    return free is None or free >= need


def make_resident(model: Any, headroom: int, memory: DeviceMemory = CUDA_MEMORY) -> torch.device:
    """Bring a reference to its home device with `headroom` working bytes free beside it, parking
    the other references there first if the device is short; returns the device. The model's own
    bytes count only while it is parked (resident, they are already allocated)."""
    residency = _REFERENCES.get(model)
    if residency is None:
        return next(model.parameters()).device
    need = headroom + (model_bytes(model) if residency.parked else 0)
    make_room(residency.home, need, keep=model, memory=memory)
    if residency.parked:
        _move(model, residency.home)
        residency.parked = False
    return residency.home


def hf_model(
    checkpoint: Path, device: torch.device, dtype: torch.dtype, memory: DeviceMemory = CUDA_MEMORY
) -> Any:
    """transformers' model of the checkpoint at `dtype`, exactly as `from_pretrained(dtype=dtype)`
    builds it: parameters in `dtype`, buffers as transformers makes them (RoPE's inv_freq stays
    float32 in a bf16 model). It is registered as a reference with `device` as its home.

    Only fp32 is reached another way: loaded as stored, then widened. Where the device has room for
    the stored and the widened bytes together (after parking the other references), it is moved
    first and widened there, so that a bf16 checkpoint is not widened on the host (48 GB of host
    work for a 12B model); otherwise it is widened on the host and then moved. Widening is exact, so
    either gives the same model. Narrowing is not done so: `.to(bfloat16)` also rounds the float32
    buffers: with inv_freq in bf16, Qwen3-4B's RoPE angles are off by up to 0.8 rad at position 700
    (the H200 run at 3a1aa3d, where the Qwen3 greedy gate's transformers stream parted from infer's
    at token 0 of its 700-token prompt, ran such a reference)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    stored_or_wanted: Any = "auto" if dtype == torch.float32 else dtype
    model: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=stored_or_wanted)
    stored = model_bytes(model)
    if dtype == torch.float32:
        widened = sum(t.numel() * 4 for t in [*model.parameters(), *model.buffers()] if t.is_floating_point())
        if make_room(device, stored + widened + WORKING_MARGIN_BYTES, memory=memory):
            model = model.to(device).float()
        else:
            print(
                f"widening the fp32 reference on the host: {device} has no room for {stored / 1e9:.1f} GB "
                f"stored and {widened / 1e9:.1f} GB widened at once"
            )
            model = model.float()
            make_room(device, widened + WORKING_MARGIN_BYTES, memory=memory)
            model = model.to(device)
    else:
        make_room(device, stored + WORKING_MARGIN_BYTES, memory=memory)
        model = model.to(device)
    _REFERENCES[model] = _Residency(home=device)
    return model.eval()


@torch.inference_mode()
def hf_logprobs(model: Any, token_ids: Sequence[int], memory: DeviceMemory = CUDA_MEMORY) -> torch.Tensor:
    """Float32 log-probs [n, vocab] at every position, on the host: a 12B model's vocabulary makes
    each such tensor gigabytes, and a gate holds several while the models stay on the device."""
    device = make_resident(model, forward_headroom(model, len(token_ids)), memory)
    logits = model(torch.tensor([list(token_ids)], device=device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


@torch.inference_mode()
def hf_greedy(
    model: Any, prompt: Sequence[int], max_new_tokens: int, memory: DeviceMemory = CUDA_MEMORY
) -> list[int]:
    device = make_resident(model, forward_headroom(model, len(prompt) + max_new_tokens), memory)
    out = model.generate(
        torch.tensor([list(prompt)], device=device),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt) :].tolist()]
