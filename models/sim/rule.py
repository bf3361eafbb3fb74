"""The sim's one rule: how a token sequence and a seed determine the next token.

`advance` folds one token into a 64-bit digest of everything before it; that digest is what the
sim keeps in its paged "KV" (one value per position). `draw` turns the digest and the request's
seed into the next token: a printable ASCII byte, or now and then EOS (never with `ignore_eos`).
`sim_completion` runs the rule over a whole prompt, so tests and the HTTP layer know exactly what
the engine must produce, whatever batching, chunking, preemption or prefix caching happened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.contract import FinishReason, SamplingParams, TokenLogprob
from engine.runner import SampledToken
from models.sim.tokenizer import EOS_TOKEN_ID

_MASK = (1 << 64) - 1
# The digest of the empty sequence: position -1.
INITIAL_STATE = 0x6A09E667F3BCC908
FIRST_PRINTABLE = 32
NUM_PRINTABLE = 95  # bytes 32..126
# About one draw in this many is EOS, so both finish reasons happen at ordinary max_tokens.
EOS_ONE_IN = 48


def _mix(x: int) -> int:
    # splitmix64's finaliser: cheap, and every input bit reaches every output bit.
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def advance(state: int, token_id: int) -> int:
    """The digest after appending `token_id` to the sequence whose digest is `state`."""
    return _mix((state ^ ((token_id + 0x9E3779B97F4A7C15) * 0xD6E8FEB86659FD93)) & _MASK)


def digest(token_ids: Sequence[int]) -> int:
    state = INITIAL_STATE
    for token in token_ids:
        state = advance(state, token)
    return state


def draw(state: int, sampling: SamplingParams) -> SampledToken:
    """The token that follows the sequence whose digest is `state`, with fake but deterministic
    log-probs when the request asks for them."""
    seed = 0 if sampling.seed is None else sampling.seed & _MASK
    h = _mix(state ^ _mix(seed ^ 0x5EED5EED5EED5EED))
    if not sampling.ignore_eos and h % EOS_ONE_IN == 0:
        token = EOS_TOKEN_ID
    else:
        token = FIRST_PRINTABLE + (h >> 8) % NUM_PRINTABLE
    logprob = None
    if sampling.logprobs is not None:
        chosen = -0.001 - ((h >> 32) % 3000) / 1000.0
        top: list[tuple[int, float]] = []
        if sampling.logprobs > 0:
            top.append((token, chosen))
            base = token - FIRST_PRINTABLE if token != EOS_TOKEN_ID else 0
            for i in range(1, sampling.logprobs):
                # 7 and 95 are coprime, so the alternatives are distinct printable bytes.
                alt = FIRST_PRINTABLE + (base + 7 * i) % NUM_PRINTABLE
                top.append((alt, chosen - 0.25 * i))
        logprob = TokenLogprob(token, chosen, tuple(top))
    return SampledToken(token, logprob)


@dataclass(frozen=True, slots=True)
class SimCompletion:
    """What the sim generates for a prompt: the committed tokens (EOS is never among them), why
    it stopped, and the log-probs when asked for."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def text(self) -> str:
        return bytes(self.token_ids).decode("ascii")


def sim_completion(prompt_token_ids: Sequence[int], sampling: SamplingParams) -> SimCompletion:
    """Exactly what the engine serving `sim` returns for this prompt, assuming it is admitted
    (the engine rejects prompt + max_tokens over max_model_len with `context_length`)."""
    state = digest(prompt_token_ids)
    tokens: list[int] = []
    logprobs: list[TokenLogprob] | None = [] if sampling.logprobs is not None else None
    while True:
        sampled = draw(state, sampling)
        if sampled.token_id == EOS_TOKEN_ID and not sampling.ignore_eos:
            reason = FinishReason.STOP
            break
        tokens.append(sampled.token_id)
        if logprobs is not None and sampled.logprob is not None:
            logprobs.append(sampled.logprob)
        if len(tokens) >= sampling.max_tokens:
            reason = FinishReason.LENGTH
            break
        state = advance(state, sampled.token_id)
    return SimCompletion(tuple(tokens), reason, tuple(logprobs) if logprobs is not None else None)
