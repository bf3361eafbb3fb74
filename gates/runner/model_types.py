"""Which checkpoint model types a suite covers.

A suite lists model lines by model type; a checkpoint is covered when its model type, or the
model type of its `text_config`, belongs to the same line. Lines: a type and its `_text` form
are one line, and Gemma 4's unified (12B) types belong to the gemma4 line. So a suite listing
`gemma4` covers gemma4, gemma4_text, gemma4_unified and gemma4_unified_text, and a suite
listing `qwen3` does not cover qwen3_5.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Model types that belong to another type's line.
_LINE_ALIASES: dict[str, str] = {"gemma4_unified": "gemma4"}


def line_of(model_type: str) -> str:
    base = model_type.removesuffix("_text")
    return _LINE_ALIASES.get(base, base)


def covered_types(suite_types: Iterable[str]) -> list[str]:
    """Every model type the suite accepts, for messages."""
    lines = {line_of(t) for t in suite_types}
    forms: set[str] = set()
    for line in lines:
        forms.update((line, f"{line}_text"))
        forms.update(alias for alias, target in _LINE_ALIASES.items() if target == line)
        forms.update(f"{alias}_text" for alias, target in _LINE_ALIASES.items() if target == line)
    return sorted(forms)


def checkpoint_types(config: Mapping[str, Any]) -> list[str]:
    """The model type of a config.json and of its text tower, if it has one."""
    types: list[str] = []
    outer = config.get("model_type")
    if isinstance(outer, str):
        types.append(outer)
    text = config.get("text_config")
    if isinstance(text, Mapping) and isinstance(text.get("model_type"), str):
        types.append(str(text["model_type"]))
    return types


def covers(suite_types: Iterable[str], types: Iterable[str]) -> bool:
    lines = {line_of(t) for t in suite_types}
    return any(line_of(t) in lines for t in types)
