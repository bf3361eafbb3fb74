"""Counter-based sampling noise: a stateless integer hash of (seed, step, token id), on device.

Each row's noise is a pure function of its own seed and step index, so a seeded request draws the
same tokens whatever batch it lands in, at whatever row, with whatever vocabulary padding. There is
no `torch.Generator` and no host loop; every op is elementwise over fixed shapes, so the whole
computation could be captured in a CUDA graph.

The hash works on 32-bit words held in int64 tensors. Multiplications are split into 16-bit
halves so that no intermediate exceeds 2**48: signed int64 overflow is undefined in C++, and we
want the same bits on every backend rather than whatever the compiler does with a wrap.

Cost note: eager torch runs each hash op as its own kernel over [rows, vocab] int64 (a few dozen
passes). The function is purely elementwise, so `torch.compile` (or a Triton kernel in `kernels/`
checked against this one) fuses it into a single pass when that matters on the GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

_WORD_MASK = 0xFFFFFFFF
_HALF_MASK = 0xFFFF

# Multipliers of a well-mixing 32-bit finaliser (shift 16, multiply, shift 15, multiply, shift 16).
_MIX_MULTIPLIER_1 = 0x7FEB352D
_MIX_MULTIPLIER_2 = 0x846CA68B

# Domain separators so the two per-row keys are independent functions of (seed, step).
_KEY_DOMAIN_1 = 0x243F6A88
_KEY_DOMAIN_2 = 0x85A308D3

# The largest float32 below 1.0: keeps the uniform strictly inside (0, 1) after rounding.
_BELOW_ONE = 1.0 - 2.0**-24


def _multiply_word_(words: Tensor, multiplier: int) -> Tensor:
    """In place: words * multiplier mod 2**32, never forming a product above 2**48."""
    high = words * (multiplier >> 16)
    high.bitwise_and_(_HALF_MASK).bitwise_left_shift_(16)
    words.mul_(multiplier & _HALF_MASK).add_(high).bitwise_and_(_WORD_MASK)
    return words


def _mix_words_(words: Tensor) -> Tensor:
    """In place: a bijective avalanche mix of 32-bit words (all inputs non-negative, < 2**32)."""
    words.bitwise_xor_(words >> 16)
    _multiply_word_(words, _MIX_MULTIPLIER_1)
    words.bitwise_xor_(words >> 15)
    _multiply_word_(words, _MIX_MULTIPLIER_2)
    words.bitwise_xor_(words >> 16)
    return words


def mix_words(words: Tensor) -> Tensor:
    """A bijective 32-bit mix of int64 tensors holding values in [0, 2**32)."""
    if words.dtype != torch.int64:
        raise TypeError(f"mix_words needs int64 words, got {words.dtype}")
    return _mix_words_(words.clone())


def row_keys(seed: Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
    """Two 32-bit keys per row from its 64-bit seed and its step index (int64 tensors, [rows])."""
    seed_low = seed & _WORD_MASK
    # Arithmetic shift then mask yields the high word's bits for negative seeds too.
    seed_high = (seed >> 32) & _WORD_MASK
    step_word = step & _WORD_MASK

    def absorb(domain: int) -> Tensor:
        state = _mix_words_(seed_low ^ domain)
        state = _mix_words_(state.bitwise_xor_(seed_high))
        return _mix_words_(state.bitwise_xor_(step_word))

    return absorb(_KEY_DOMAIN_1), absorb(_KEY_DOMAIN_2)


def uniform_noise(seed: Tensor, step: Tensor, vocab_size: int) -> Tensor:
    """Uniforms in (0, 1), float32 [rows, vocab_size]; entry (r, v) depends only on
    (seed[r], step[r], v) — not on the row's position, the batch size, or `vocab_size`."""
    key_1, key_2 = row_keys(seed, step)
    token_ids = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    # Keying the token id twice, with two independent row keys, keeps two rows whose first keys
    # happen to differ by a few low bits from seeing shifted copies of one another's noise.
    words = token_ids.unsqueeze(0) ^ key_1.unsqueeze(1)
    _mix_words_(words)
    words.bitwise_xor_(key_2.unsqueeze(1))
    _mix_words_(words)
    uniform = words.to(torch.float32).add_(0.5).mul_(2.0**-32)
    return uniform.clamp_(max=_BELOW_ONE)


def gumbel_noise(seed: Tensor, step: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise, float32 [rows, vocab_size], as `uniform_noise` keys it.

    Drawn as -log(E) with E = -log(1 - U) exponential: `log1p` keeps E accurate when it is tiny,
    which is where the large (decisive) Gumbel values come from. The range is bounded,
    about [-2.8, 22.9]; a token more than ~25 nats below the best one can never win, an error
    below 1e-10 in probability.
    """
    uniform = uniform_noise(seed, step, vocab_size)
    exponential = torch.log1p(uniform.neg_()).neg_()
    return exponential.log_().neg_()
