"""Incremental detokenization and stop-string hold-back, on their own."""

from __future__ import annotations

import pytest

from infer_cli.http.detokenizer import IncrementalDetokenizer
from infer_cli.http.stop_strings import OutputText
from models.sim import SimTokenizer

TOK = SimTokenizer()
TEXT = "h\u00e9llo w\u00f6rld \u2713 \U0001f600 done"


def test_multibyte_characters_come_out_whole() -> None:
    detok = IncrementalDetokenizer(TOK, tuple(TOK.encode("prompt: ")))
    deltas = [detok.add(t) for t in TOK.encode(TEXT)]
    deltas.append(detok.flush())
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # The 4-byte emoji is held back for three tokens and comes out with the fourth.
    emoji_start = len(TOK.encode(TEXT[: TEXT.index("\U0001f600")]))
    assert deltas[emoji_start : emoji_start + 4] == ["", "", "", "\U0001f600"]


def test_flush_releases_an_incomplete_character() -> None:
    detok = IncrementalDetokenizer(TOK)
    assert detok.add(TOK.encode("\u00e9")[0]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_prompt_ending_inside_a_character_does_not_leak_into_the_output() -> None:
    prompt = tuple(TOK.encode("ab\u00e9")[:-1])
    detok = IncrementalDetokenizer(TOK, prompt)
    out = "".join(detok.add(t) for t in TOK.encode("xyz")) + detok.flush()
    # Not "\ufffdxyz" (the prompt's broken tail) and not "ab..." (the prompt itself).
    assert out == "xyz"


@pytest.mark.parametrize(
    ("deltas", "stops", "final"),
    [
        (["xa", "b", "cz"], ("abc",), "x"),
        (["hello ", "wor", "ld"], ("world", "lo w"), "hel"),
        (["abc"], ("c", "b"), "a"),
        (["no", " stop"], ("zz",), "no stop"),
    ],
)
def test_stop_strings_split_across_deltas(deltas: list[str], stops: tuple[str, ...], final: str) -> None:
    out = OutputText(stops)
    sent = ""
    for delta in deltas:
        out.append(delta)
        sent += out.take(final=False)
        # Nothing sent may be taken back: it must be a prefix of the final text.
        assert final.startswith(sent)
    sent += out.take(final=True)
    assert sent == final == out.final_text
    assert out.stopped == (final != "".join(deltas))


def test_without_stop_strings_nothing_is_held_back() -> None:
    out = OutputText(())
    out.append("abc")
    assert out.take(final=False) == "abc"
