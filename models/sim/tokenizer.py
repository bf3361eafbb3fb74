"""The sim's byte-level tokenizer: ids 0..255 are bytes, so text round-trips exactly."""

from __future__ import annotations

from collections.abc import Sequence

from models.registry import ChatMessage

BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
TURN_START_TOKEN_ID = 258
TURN_END_TOKEN_ID = 259
VOCAB_SIZE = 260

SPECIAL_TOKENS: dict[int, str] = {
    BOS_TOKEN_ID: "<bos>",
    EOS_TOKEN_ID: "<eos>",
    TURN_START_TOKEN_ID: "<turn>",
    TURN_END_TOKEN_ID: "</turn>",
}


class SimTokenizer:
    """UTF-8 bytes in, bytes out. Special tokens are never produced by `encode` (text that spells
    "<eos>" is just bytes) and are skipped by `decode`."""

    bos_token_id = BOS_TOKEN_ID
    eos_token_ids: frozenset[int] = frozenset({EOS_TOKEN_ID})
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """<bos> then, per message, <turn>role\\ncontent</turn>\\n; then <turn>assistant\\n so the
        model's answer follows."""
        ids = [BOS_TOKEN_ID]
        for message in messages:
            ids.append(TURN_START_TOKEN_ID)
            ids.extend(self.encode(f"{message.role}\n{message.content}"))
            ids.append(TURN_END_TOKEN_ID)
            ids.extend(self.encode("\n"))
        ids.append(TURN_START_TOKEN_ID)
        ids.extend(self.encode("assistant\n"))
        return ids
