"""A view of a checkpoint with a few config.json fields changed: every other file is a symlink, so a
gate can move a limit (say, the context ceiling) without copying weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def with_text_config(checkpoint: Path, out: Path, **fields: Any) -> Path:
    """`out`, holding `checkpoint` with `fields` set in the text config (`text_config` when the
    config nests one, the top level otherwise)."""
    out.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    target = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    target.update(fields)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
