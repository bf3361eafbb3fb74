"""config.json, the tokenizer files and generation_config.json, from a GGUF file's metadata.

All three come from transformers' GGUF integration (its config and tokenizer mappings, reached
through `from_pretrained(..., gguf_file=...)`), so the directory says what transformers' own GGUF
load would: the same config fields, the same tokenizer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from models.gguf.deps import import_transformers
from models.gguf.errors import GGUFError


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    # transformers logs every metadata key it does not map; the conversion reports what matters.
    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logger.setLevel(level)


def write_metadata(path: Path, out: Path, dtype: torch.dtype) -> dict[str, Any]:
    """Write the directory's JSON files; return the config as written. `dtype` is the widest
    float type of the converted tensors, recorded as the config's `dtype`."""
    transformers = import_transformers()
    folder, name = str(path.parent), path.name
    with _quiet_transformers():
        try:
            config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except (ValueError, KeyError, NotImplementedError) as exc:
            raise GGUFError(f"{path}: transformers cannot read its config or tokenizer: {exc}") from exc
        config.dtype = dtype
        config.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        transformers.GenerationConfig.from_model_config(config).save_pretrained(str(out))
    written: dict[str, Any] = config.to_dict()
    return written
