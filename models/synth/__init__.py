"""`infer synth`: synthetic Hugging Face checkpoints with real tensor names and random weights.

Families qwen3, gemma3, gemma4 and qwen35 (model types qwen3, gemma3_text, gemma4_text,
qwen3_5_text; qwen35 also in its published multimodal form, qwen3_5); a `tiny` preset per family
for CPU tests and the published dimensions for GPU benchmarks. See docs/synth.md. The writer
(torch, transformers) is imported on first use, so listing families and presets stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from models.synth.errors import SynthError
from models.synth.families import FAMILIES, get_family

if TYPE_CHECKING:
    from models.synth.writer import SynthRequest, SynthResult, plan, synthesize

_WRITER_NAMES = ("SynthRequest", "SynthResult", "plan", "synthesize")


def __getattr__(name: str) -> Any:
    if name in _WRITER_NAMES:
        from models.synth import writer

        return getattr(writer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FAMILIES", "SynthError", "SynthRequest", "SynthResult", "get_family", "plan", "synthesize"]
