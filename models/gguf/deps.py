"""The two libraries conversion stands on, imported with a clear error when the extra is missing.

`gguf` (llama.cpp's reader) reads the file and dequantizes its blocks; transformers turns the
metadata into a config and a tokenizer and states the Hugging Face tensor names and shapes.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

from models.gguf.errors import MissingGGUFDependencyError


def import_gguf() -> ModuleType:
    if importlib.util.find_spec("gguf") is None:
        raise MissingGGUFDependencyError("gguf", "reading a GGUF file")
    import gguf

    return gguf


def import_transformers() -> ModuleType:
    if importlib.util.find_spec("transformers") is None:
        raise MissingGGUFDependencyError("transformers", "a GGUF file's config and tokenizer")
    import transformers

    return transformers
