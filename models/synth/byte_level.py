"""The byte ↔ printable-character map byte-level BPE vocabularies are written in.

Byte-level BPE (GPT-2, Qwen) stores each token as a string with one printable character per
byte: bytes that are already visible Latin-1 characters stand for themselves, the other 68
(controls, space, soft hyphen, ...) are shifted to code points from 256 up, in byte order.
"""

from __future__ import annotations

from functools import cache


@cache
def byte_to_char() -> dict[int, str]:
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in visible}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def bytes_to_token(raw: bytes) -> str:
    table = byte_to_char()
    return "".join(table[byte] for byte in raw)
