"""infer encodes prompts exactly as transformers' AutoTokenizer encodes them, on every tokenizer the
project makes: each `infer synth` family with each vocabulary kind it offers, plus variants that
pin whose word decides the special tokens (tokenizer.json's post-processor or tokenizer_config.json).

Completions: `HFTokenizer.encode(text)` == `AutoTokenizer(text)["input_ids"]`.
Chat: `HFTokenizer.render_chat(messages)` == `apply_chat_template(..., add_generation_prompt=True)`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from models.chat_templates import CHATML
from models.hf_tokenizer import HFTokenizer
from models.registry import ChatMessage
from models.synth.families import get_family
from models.synth.tokenizer_build import BuiltTokenizer, build_tokenizer

TEXTS = (
    "The quick brown fox",
    "",
    " two  spaces,\ta tab and a newline\n",
    "héllo wörld — naïve café 😀",
    "mid-text specials: <|im_start|> and <turn|> and <bos> stay what they are",
    "1234567890 + 0.5 = ?",
)

CONVERSATIONS = (
    (ChatMessage("user", "The quick brown fox"),),
    (
        ChatMessage("system", "You are terse."),
        ChatMessage("user", "  Name a prime number.  "),
        ChatMessage("assistant", "Seven."),
        ChatMessage("user", "Another one?"),
    ),
)

# (family, vocabulary kind, vocab_size): every tokenizer `infer synth` writes. The published
# presets of a family share one vocabulary size; `tiny` trains a 1,024-id vocabulary.
SYNTH_TOKENIZERS = (
    ("qwen3", "trained", 1024),
    pytest.param("qwen3", "real", 151936, marks=pytest.mark.slow),
    ("qwen35", "trained", 1024),
    pytest.param("qwen35", "real", 248320, marks=pytest.mark.slow),
    ("gemma4", "trained", 1024),
    ("gemma4", "trained", 262144),
)


def _write(directory: Path, tokenizer_json: dict[str, Any], config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return directory


def _built(family: str, kind: str, vocab_size: int) -> BuiltTokenizer:
    return build_tokenizer(get_family(family), kind, vocab_size, 4096)  # type: ignore[arg-type]


def _auto_tokenizer(directory: Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _hf_chat(hf: Any, messages: tuple[ChatMessage, ...]) -> list[int]:
    out = hf.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=True
    )
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(i) for i in ids]


def _assert_parity(directory: Path) -> None:
    hf = _auto_tokenizer(directory)
    ours = HFTokenizer(directory)
    for text in TEXTS:
        want = hf(text)["input_ids"]
        got = ours.encode(text)
        assert got == want, f"{directory.name}: encode({text!r})\ninfer        {got}\ntransformers {want}"
    if ours.chat_template is None:
        return
    for messages in CONVERSATIONS:
        want = _hf_chat(hf, messages)
        got = ours.render_chat(messages)
        assert got == want, (
            f"{directory.name}: chat of {len(messages)}\ninfer        {got}\ntransformers {want}"
        )


@pytest.mark.parametrize(("family", "kind", "vocab_size"), SYNTH_TOKENIZERS)
def test_synth_tokenizers_encode_as_transformers(
    family: str, kind: str, vocab_size: int, tmp_path: Path
) -> None:
    built = _built(family, kind, vocab_size)
    directory = _write(
        tmp_path / f"{family}-{kind}-{vocab_size}", json.loads(built.to_json()), dict(built.config)
    )
    _assert_parity(directory)


def test_gemma4_completion_prompt_starts_with_bos(tmp_path: Path) -> None:
    """The case that was wrong: transformers gives <bos> + 11 text tokens; infer dropped the <bos>."""
    built = _built("gemma4", "trained", 1024)
    directory = _write(tmp_path / "gemma4", json.loads(built.to_json()), dict(built.config))
    hf, ours = _auto_tokenizer(directory), HFTokenizer(directory)
    bos = built.id_of("<bos>")
    want = hf("The quick brown fox")["input_ids"]
    assert want[0] == bos and bos not in want[1:]
    assert ours.encode("The quick brown fox") == want


# --- who decides the special tokens -------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_files() -> tuple[dict[str, Any], dict[str, Any]]:
    built = _built("gemma4", "trained", 1024)
    return json.loads(built.to_json()), dict(built.config)


Variant = Callable[[dict[str, Any], dict[str, Any]], None]


def _no_post_processor(tokenizer: dict[str, Any], config: dict[str, Any]) -> None:
    # tokenizer_config.json still says add_bos_token: true; transformers 5 does not follow it.
    tokenizer["post_processor"] = None


def _config_says_no_bos(tokenizer: dict[str, Any], config: dict[str, Any]) -> None:
    config["add_bos_token"] = False


def _bos_and_eos(tokenizer: dict[str, Any], config: dict[str, Any]) -> None:
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    config["add_eos_token"] = True
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<bos>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<eos>", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": "<bos>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<eos>", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {
            name: {"id": name, "ids": [ids[name]], "tokens": [name]} for name in ("<bos>", "<eos>")
        },
    }


def _byte_level_then_template(tokenizer: dict[str, Any], config: dict[str, Any]) -> None:
    # The Llama 3 shape: a Sequence of ByteLevel (offsets only) and the BOS template.
    template = tokenizer["post_processor"]
    tokenizer["post_processor"] = {
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
            template,
        ],
    }


def _chatml_without_bos(tokenizer: dict[str, Any], config: dict[str, Any]) -> None:
    # A template that writes no BOS on a tokenizer that prepends one: the chat gets none, as in
    # transformers (the rendered text is encoded without special tokens).
    config["chat_template"] = CHATML


VARIANTS: dict[str, Variant] = {
    "no-post-processor": _no_post_processor,
    "config-says-no-bos": _config_says_no_bos,
    "bos-and-eos": _bos_and_eos,
    "byte-level-then-template": _byte_level_then_template,
    "chatml-without-bos": _chatml_without_bos,
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_encode_as_transformers(
    name: str, gemma_files: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    tokenizer, config = copy.deepcopy(gemma_files[0]), copy.deepcopy(gemma_files[1])
    VARIANTS[name](tokenizer, config)
    _assert_parity(_write(tmp_path / name, tokenizer, config))


def test_a_prompt_that_already_starts_with_bos_keeps_one(
    gemma_files: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    """A client that renders the chat template itself sends text starting with "<bos>":
    transformers would prepend a second one; infer keeps the one the text has."""
    directory = _write(tmp_path / "gemma4", *gemma_files)
    hf, ours = _auto_tokenizer(directory), HFTokenizer(directory)
    bos = hf.bos_token_id
    text = "<bos><|turn>user\nThe quick brown fox<turn|>\n<|turn>model\n"
    doubled = hf(text)["input_ids"]
    assert doubled[:2] == [bos, bos], "transformers doubles it (the case the guard exists for)"
    assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"] == doubled[1:]
    # BOS twice in the text itself is the client's choice, and a BOS later on is text: both kept.
    assert ours.encode("<bos><bos>x") == hf("<bos><bos>x", add_special_tokens=False)["input_ids"]
    assert ours.encode("x<bos>") == hf("x<bos>")["input_ids"]


def test_a_config_that_disagrees_with_the_post_processor_is_logged(
    gemma_files: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer, config = copy.deepcopy(gemma_files[0]), copy.deepcopy(gemma_files[1])
    _no_post_processor(tokenizer, config)
    with caplog.at_level("WARNING", logger="models.hf_tokenizer"):
        HFTokenizer(_write(tmp_path / "disagrees", tokenizer, config))
    assert any(
        "add_bos_token=True" in r.getMessage() and "does not add" in r.getMessage() for r in caplog.records
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="models.hf_tokenizer"):
        HFTokenizer(_write(tmp_path / "agrees", *gemma_files))
    assert not caplog.records
