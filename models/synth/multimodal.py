"""The published (multimodal) form's parts that come from transformers: the vision tower's config
and the processor files a multimodal server loads at start.

Both are transformers' own classes at their defaults, saved by transformers (`to_diff_dict`,
`save_pretrained`); only what ties them to this checkpoint is set: the tower's output width (the
text hidden size, so the merger feeds the text tower) and the processors' patch geometry (the
tower's, so the patches they cut are the ones its patch embedding takes). docs/synth.md, "Forms".
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.synth.errors import SynthError
from models.synth.family import MultimodalForm
from models.synth.hf import import_transformers

IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_FILES = (IMAGE_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE, CHAT_TEMPLATE_FILE)


def transformers_class(reference: str) -> Any:
    """`module:Class` → the class (transformers is checked for first, with a clear error)."""
    import_transformers()
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def vision_config_body(form: MultimodalForm, preset: str, text_hidden_size: int) -> dict[str, Any]:
    """The `vision_config` of config.json: transformers' defaults, the preset's fields over them (a
    preset the form has; `writer.plan` refuses the others before anything is written)."""
    config_class = transformers_class(form.vision_config_class)
    config = config_class(**form.vision_fields[preset], out_hidden_size=text_hidden_size)
    body: dict[str, Any] = config.to_diff_dict()
    # The outer config.json carries the version once.
    body.pop("transformers_version", None)
    return dict(sorted(body.items()))


def write_processor_files(
    out: Path, form: MultimodalForm, vision: Mapping[str, Any], chat_template: str
) -> None:
    """`PROCESSOR_FILES`: the image and video processor configs and the chat template; the
    tokenizer files are the text form's, already written."""
    geometry = {
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
    }
    for reference, written in (
        (form.processor.image_processor, IMAGE_PROCESSOR_FILE),
        (form.processor.video_processor, VIDEO_PROCESSOR_FILE),
    ):
        transformers_class(reference)(**geometry).save_pretrained(str(out))
        if not (out / written).is_file():
            raise SynthError(f"{reference}.save_pretrained did not write {written} in {out}")
    (out / CHAT_TEMPLATE_FILE).write_text(chat_template)
