"""The families `infer synth` knows, by CLI name."""

from __future__ import annotations

from models.synth.errors import UnknownFamilyError
from models.synth.families.gemma3 import GEMMA3
from models.synth.families.gemma4 import GEMMA4
from models.synth.families.qwen3 import QWEN3
from models.synth.families.qwen35 import QWEN35
from models.synth.family import Family

FAMILIES: dict[str, Family] = {family.name: family for family in (QWEN3, GEMMA3, GEMMA4, QWEN35)}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownFamilyError(name, tuple(FAMILIES)) from None


__all__ = ["FAMILIES", "get_family"]
