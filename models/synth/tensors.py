"""Which tensors a checkpoint holds, and their random values.

The tensor list comes from transformers itself: the architecture the written config.json names
(the family's CausalLM, or the multimodal class of the published form) is instantiated from it on
the meta device (no memory), so names and shapes are exactly what `from_pretrained` expects, tied
weights included once. Values are drawn per tensor from a generator seeded by (seed, tensor
name): independent of order and of which other tensors exist, so one tensor can be produced,
written and freed at a time.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from models.synth.errors import InitRuleError
from models.synth.family import InitRule
from models.synth.hf import import_transformers

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True, frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_tensors(checkpoint: Path, dtype: torch.dtype) -> list[TensorSpec]:
    """The checkpoint's tensors, in the model's own order, from its config.json."""
    transformers = import_transformers()
    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)
    try:
        config = transformers.AutoConfig.from_pretrained(str(checkpoint))
        # The class config.json names (the published form's multimodal one); a config that names
        # none (a GGUF conversion's) is read as a CausalLM.
        named = getattr(config, "architectures", None) or ()
        with torch.device("meta"):
            if named:
                model = getattr(transformers, named[0])._from_config(config)
            else:
                model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        hf_logger.setLevel(level)
    # Tied weights (Gemma's and the small Qwens' lm_head) are one Parameter under two names;
    # `named_parameters` yields it once, under the name the checkpoint stores.
    specs = [TensorSpec(name, tuple(param.shape), dtype) for name, param in model.named_parameters()]
    every_param_name = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    # Persistent buffers are part of the checkpoint too (Gemma 4's per-layer `layer_scalar`).
    for name, buffer in model.state_dict().items():
        if name not in every_param_name:
            specs.append(TensorSpec(name, tuple(buffer.shape), dtype))
    return specs


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rule_for(spec: TensorSpec, rules: tuple[InitRule, ...], std: float) -> InitRule:
    for rule in rules:
        if rule.matches(spec.name):
            return rule
    if len(spec.shape) >= 2:
        return InitRule("", "normal", std)
    raise InitRuleError(spec.name, spec.shape)


def materialise(
    spec: TensorSpec, rule: InitRule, seed: int, device: torch.device, seed_name: str | None = None
) -> torch.Tensor:
    """The tensor's values on the CPU, in its dtype; drawn on `device` (the same seed gives the
    same bits on the same kind of device; CPU and CUDA generators differ). `seed_name` (default:
    the tensor's name) is the name the draw is seeded by: the published form draws its text tower
    by the text form's names."""
    generator = torch.Generator(device=device)
    generator.manual_seed(tensor_seed(seed, spec.name if seed_name is None else seed_name))
    if rule.kind in ("normal", "centred", "head_scaled"):
        values = torch.randn(spec.shape, generator=generator, device=device, dtype=torch.float32)
        if rule.kind == "normal":
            values.mul_(rule.a)
        else:
            values.mul_(rule.b).add_(rule.a)
        if rule.kind == "head_scaled":
            values.mul_(spec.shape[-1] ** -0.25)
    else:
        values = torch.rand(spec.shape, generator=generator, device=device, dtype=torch.float32)
        values.mul_(rule.b - rule.a).add_(rule.a)
        if rule.kind == "log_uniform":
            values.log_()
    return values.to(spec.dtype).cpu()
