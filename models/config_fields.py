"""Typed reads of `config.json` fields that fail closed, naming the field and its value.

Every model line's `config.py` parses its checkpoint's config through these, before any weight is
read, so an unsupported or malformed checkpoint is refused with a message a user can act on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_MISSING = object()


class ConfigError(ValueError):
    """A config field that is missing, malformed or unsupported."""

    def __init__(self, source: str, field: str, value: object, why: str) -> None:
        super().__init__(f"{source}: field {field!r} = {value!r}: {why}")
        self.source = source
        self.field = field
        self.value = value
        self.why = why


class ConfigReader:
    """Reads one JSON object (a config or a nested part of one) with typed, named failures."""

    def __init__(self, data: Mapping[str, Any], source: str, prefix: str = "") -> None:
        self.data = data
        self.source = source
        self.prefix = prefix

    @classmethod
    def from_file(cls, path: Path) -> ConfigReader:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(str(path), "<file>", None, "file not found") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(str(path), "<file>", None, f"not valid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(str(path), "<root>", type(data).__name__, "expected a JSON object")
        return cls(data, str(path))

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: object = _MISSING) -> Any:
        if key in self.data and self.data[key] is not None:
            return self.data[key]
        if default is _MISSING:
            raise ConfigError(self.source, self.name(key), None, "required but missing")
        return default

    def fail(self, key: str, why: str) -> ConfigError:
        return ConfigError(self.source, self.name(key), self.data.get(key), why)

    def get_int(self, key: str, default: int | None = None, minimum: int | None = 1) -> int:
        value = self.raw(key, _MISSING if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, "expected an integer")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be at least {minimum}")
        return value

    def get_float(self, key: str, default: float | None = None) -> float:
        value = self.raw(key, _MISSING if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, "expected a number")
        return float(value)

    def get_bool(self, key: str, default: bool | None = None) -> bool:
        value = self.raw(key, _MISSING if default is None else default)
        if not isinstance(value, bool):
            raise self.fail(key, "expected true or false")
        return value

    def get_str(self, key: str, default: str | None = None) -> str:
        value = self.raw(key, _MISSING if default is None else default)
        if not isinstance(value, str):
            raise self.fail(key, "expected a string")
        return value

    def sub(self, key: str) -> ConfigReader:
        value = self.raw(key)
        if not isinstance(value, dict):
            raise self.fail(key, "expected a JSON object")
        return ConfigReader(value, self.source, prefix=f"{self.name(key)}.")

    def require_value(self, key: str, allowed: tuple[object, ...], default: object = _MISSING) -> object:
        value = self.raw(key, default)
        if value not in allowed:
            raise self.fail(key, f"not supported (supported: {', '.join(map(repr, allowed))})")
        return value

    def token_ids(self, key: str) -> frozenset[int]:
        """An id or a list of ids (EOS fields use both forms); empty when absent."""
        value = self.data.get(key)
        if value is None:
            return frozenset()
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise self.fail(key, "expected a token id or a list of token ids")
        return frozenset(values)


def generation_token_ids(checkpoint: Path, key: str) -> frozenset[int]:
    """An id field of generation_config.json (`eos_token_id`, `suppress_tokens`); empty when the
    checkpoint ships no such file or field."""
    path = checkpoint / "generation_config.json"
    if not path.is_file():
        return frozenset()
    return ConfigReader.from_file(path).token_ids(key)


def eos_token_ids(checkpoint: Path, *configs: ConfigReader) -> frozenset[int]:
    """The EOS set: generation_config.json's, else the first of `configs` that names one. A
    checkpoint that names none is refused: the engine could never stop on its own."""
    eos = generation_token_ids(checkpoint, "eos_token_id")
    for config in configs:
        eos = eos or config.token_ids("eos_token_id")
    if not eos:
        raise ConfigError(
            str(checkpoint), "eos_token_id", None, "no EOS id in generation_config.json or config.json"
        )
    return eos


# Layer-type names as Hugging Face's `layer_types` spells them (every sliding-window line uses these).
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"

_SERVABLE_DTYPES = ("bfloat16", "float16", "float32")


def checkpoint_dtype(*configs: ConfigReader, default: str = "bfloat16") -> str:
    """The stored dtype: `dtype` (newer transformers) or `torch_dtype`, from the first of `configs`
    that names one (a multimodal checkpoint's outer config before its text tower)."""
    for reader in configs:
        for key in ("dtype", "torch_dtype"):
            if reader.has(key):
                value = reader.get_str(key)
                if value not in _SERVABLE_DTYPES:
                    raise reader.fail(key, "expected bfloat16, float16 or float32")
                return value
    return default


def text_tower(
    outer: ConfigReader, outer_types: tuple[str, ...], text_types: tuple[str, ...]
) -> tuple[ConfigReader, ConfigReader]:
    """(text config, the config carrying dtype and EOS). A text type is its own tower; an outer
    (multimodal) type `T` keeps its tower under `text_config`, of model type `T_text`."""
    model_type = outer.require_value("model_type", outer_types + text_types)
    if model_type in text_types:
        return outer, outer
    text = outer.sub("text_config")
    text.require_value("model_type", (f"{model_type}_text",), default=f"{model_type}_text")
    return text, outer
