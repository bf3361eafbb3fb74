"""The config.json and generation_config.json bodies of a synthetic checkpoint.

config.json is spelled as the family's published file is (see each family module); the token
ids come from the tokenizer actually written beside it, so they agree by construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

from models.synth.family import Family, MultimodalForm, Preset
from models.synth.tokenizer_build import BuiltTokenizer


@dataclass(slots=True, frozen=True)
class DecoderDims:
    """The sizes every family's config.json names under the same keys."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool = True


def tiny_dims(*, num_hidden_layers: int, head_dim: int, tie_word_embeddings: bool = True) -> DecoderDims:
    """The width every family's tiny preset shares: a 1024-token vocabulary, 64 wide, a 192-wide
    MLP, 4 query heads over 2 KV heads and a 4096-token context; depth and head dim are the
    family's."""
    return DecoderDims(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
    )


def decoder_fields(dims: DecoderDims, **family_fields: Any) -> MappingProxyType[str, Any]:
    """A preset's config fields: the keys all families spell alike, plus the family's own.

    Keys come out sorted, as every published config.json here lists them.
    """
    body: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "use_cache": True,
        **asdict(dims),
    }
    clash = sorted(set(body) & set(family_fields))
    if clash:
        raise ValueError(
            f"family config fields {clash} are already set by DecoderDims or the shared defaults"
        )
    body.update(family_fields)
    return MappingProxyType(dict(sorted(body.items())))


def periodic_layer_types(num_layers: int, period: int, *, other: str, last_full: bool = False) -> list[str]:
    """Every `period`-th layer is "full_attention", the rest `other`; `last_full` forces the last one full."""
    return [
        "full_attention" if (i + 1) % period == 0 or (last_full and i == num_layers - 1) else other
        for i in range(num_layers)
    ]


def config_body(
    family: Family,
    preset: Preset,
    vocab_size: int,
    tokenizer: BuiltTokenizer,
    dtype: str,
    transformers_version: str,
) -> dict[str, Any]:
    body: dict[str, Any] = dict(preset.fields)
    body["vocab_size"] = vocab_size
    if "vocab_size_per_layer_input" in body:
        body["vocab_size_per_layer_input"] = vocab_size
    body["architectures"] = [family.architecture]
    body["model_type"] = family.model_type
    body[family.dtype_key] = dtype
    body["transformers_version"] = transformers_version
    roles = family.roles
    for key, content in (
        ("bos_token_id", roles.bos),
        ("eos_token_id", roles.eos),
        ("pad_token_id", roles.pad),
    ):
        if content is not None:
            body[key] = tokenizer.id_of(content)
    return dict(sorted(body.items()))


# Fields of a config.json body that belong to the outer config alone in the published form.
_OUTER_ONLY = ("architectures", "transformers_version")


def published_config_body(
    family: Family,
    form: MultimodalForm,
    text_body: dict[str, Any],
    vision_body: dict[str, Any],
    tokenizer: BuiltTokenizer,
) -> dict[str, Any]:
    """The published form's config.json: `text_body` (the text form's config.json) under
    `text_config` less the outer-only fields, the vision tower under `vision_config`, and the
    outer fields the published file has (architecture, model type, the multimodal token ids, the
    tie and the dtype, which the published files state both outside and in `text_config`)."""
    body: dict[str, Any] = {
        "architectures": [form.architecture],
        "model_type": form.model_type,
        "text_config": {key: value for key, value in text_body.items() if key not in _OUTER_ONLY},
        "vision_config": vision_body,
        "tie_word_embeddings": text_body["tie_word_embeddings"],
        family.dtype_key: text_body[family.dtype_key],
        "transformers_version": text_body["transformers_version"],
    }
    for key, content in form.token_fields.items():
        body[key] = tokenizer.id_of(content)
    return dict(sorted(body.items()))


def generation_body(family: Family, tokenizer: BuiltTokenizer, transformers_version: str) -> dict[str, Any]:
    roles = family.roles
    eos_ids = [tokenizer.id_of(content) for content in roles.generation_eos]
    body: dict[str, Any] = dict(family.generation_defaults)
    body["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    if roles.generation_bos is not None:
        body["bos_token_id"] = tokenizer.id_of(roles.generation_bos)
    if roles.generation_pad is not None:
        body["pad_token_id"] = tokenizer.id_of(roles.generation_pad)
    body["transformers_version"] = transformers_version
    return dict(sorted(body.items()))
