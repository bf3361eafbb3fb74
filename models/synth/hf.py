"""The one place models/synth touches transformers: a clear error when it is missing."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from models.synth.errors import MissingDependencyError


def import_transformers() -> ModuleType:
    if importlib.util.find_spec("transformers") is None:
        raise MissingDependencyError(
            "transformers",
            "infer synth (it builds every model from its transformers config)",
            "pip install 'transformers>=5.5' (the project's `test` extra includes it)",
        )
    import transformers

    return transformers
