"""Incremental detokenization: token ids in, text deltas out, one token at a time.

Decoding each new token alone is wrong for real tokenizers: a character can span several tokens
(byte-level BPE) and a token's leading space can depend on its neighbour (SentencePiece). So each
step decodes a short window that ends at the new token and starts a few tokens back, emits only what
the window adds past the text already emitted, and holds back while the window ends in an
incomplete character (U+FFFD) until the next token completes it.
"""

from __future__ import annotations

from models.registry import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context for the first generated tokens.
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    __slots__ = ("_ids", "_prefix", "_prefix_text", "_read", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: tuple[int, ...] = ()) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        context_text = tokenizer.decode(context) if context else ""
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character; new tokens would complete it and the emitted text
            # would start with the prompt's tail. Start without context instead.
            context, context_text = [], ""
        self._ids: list[int] = context
        # Window [prefix, read) is text already accounted for; [read, len) is not yet emitted.
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = context_text

    def add(self, token_id: int) -> str:
        """The text the new token completes; empty while a character is still incomplete."""
        self._ids.append(token_id)
        window_text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""
        return self._advance(window_text)

    def flush(self) -> str:
        """At the end of generation: whatever is held back, incomplete characters included."""
        if self._read == len(self._ids):
            return ""
        window_text = self._tokenizer.decode(self._ids[self._prefix :])
        return self._advance(window_text)

    def _advance(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        return delta
