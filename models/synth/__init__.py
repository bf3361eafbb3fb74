"""`infer synth`: synthetic Hugging Face checkpoints with real tensor names and random weights.

Families qwen3, gemma4 and qwen35 (model types qwen3, gemma4_text, qwen3_5_text); a `tiny`
preset per family for CPU tests and the published dimensions for GPU benchmarks. See
docs/synth.md.
"""

from __future__ import annotations

from models.synth.errors import SynthError
from models.synth.families import FAMILIES, get_family
from models.synth.writer import SynthRequest, SynthResult, plan, synthesize

__all__ = ["FAMILIES", "SynthError", "SynthRequest", "SynthResult", "get_family", "plan", "synthesize"]
