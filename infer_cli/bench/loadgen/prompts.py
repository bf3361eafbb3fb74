"""Random prompts of a target token length, for any server, without its tokenizer.

The text is random lowercase words. How many tokens a server makes of it is learned from the server
itself: two probe requests of different lengths give tokens per character and the fixed overhead
(a chat template's tokens), and prompts are sized from that. For a byte-level tokenizer such as
the sim's the lengths come out exact; for a BPE tokenizer close, and the benchmark counts the real
numbers from each response's `usage` either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def random_text(rng: random.Random, num_chars: int) -> str:
    """Exactly `num_chars` characters of space-separated random words (2 to 8 letters)."""
    pieces: list[str] = []
    size = -1  # the joined length: no separator before the first word
    while size < num_chars:
        word = "".join(rng.choices(_LETTERS, k=rng.randint(2, 8)))
        pieces.append(word)
        size += len(word) + 1
    return " ".join(pieces)[:num_chars]


class PromptSizeError(ValueError):
    def __init__(self, input_len: int, overhead: float) -> None:
        super().__init__(
            f"--input-len {input_len} is not more than the server's fixed prompt overhead "
            f"(~{overhead:.0f} tokens, e.g. a chat template)"
        )
        self.input_len = input_len
        self.overhead = overhead


@dataclass(frozen=True, slots=True)
class TokenRate:
    """What the server makes of `random_text`: tokens = per_char * chars + overhead."""

    per_char: float
    overhead: float

    @classmethod
    def from_probes(cls, chars: tuple[int, int], tokens: tuple[int, int]) -> TokenRate:
        (c1, c2), (t1, t2) = chars, tokens
        if c2 == c1:
            raise ValueError("probe prompts must differ in length")
        per_char = (t2 - t1) / (c2 - c1)
        if per_char <= 0:
            raise ValueError(f"server reported {t1} and {t2} prompt tokens for {c1} and {c2} characters")
        return cls(per_char, t1 - per_char * c1)

    def chars_for(self, input_len: int) -> int:
        chars = round((input_len - self.overhead) / self.per_char)
        if chars < 1:
            raise PromptSizeError(input_len, self.overhead)
        return chars


def make_prompts(seed: int, count: int, num_chars: int) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng, num_chars) for _ in range(count)]
