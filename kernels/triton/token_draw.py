"""The token draw of every row in one launch plus a fixed-order finish (``kernels.reference.draw_tokens``).

The vocabulary is cut into chunks of ``CHUNK`` tokens; program ``(row, chunk)`` computes, for each of
its tokens, the row's score (greedy rows: the raw logit; other rows: ``logit / temperature`` with
IEEE division, plus the Gumbel noise hashed from (seed, step, token id) in native uint32, ``-inf``
where min-p or the ``keep`` mask filters the token) and writes the chunk's best (score, token id),
ties to the lower id. The finishing launch takes, per row, the best of its chunks in chunk order.
Max and argmax are exact, so a row's token is a function of that row alone whatever the batch, the
chunking or the launch geometry, and no sum over tokens is taken anywhere.

Min-p needs the row's maximum of the scaled logits before any token can be judged: the caller passes
``row_max`` (the raw logits' row maximum, ``amax``; exact), and ``row_max / temperature`` is exactly
the scaled row maximum because a correctly rounded divide by a positive number is monotone.

The integer hash is bit-exact against the spec. The transform to Gumbel noise uses libdevice's
``log1p`` / ``log`` / ``exp`` on the GPU (the functions torch's CUDA kernels call); under the
interpreter ``log1p`` is a formula in ``log`` accurate to a few fp32 ulps, so the scores may differ
from the spec's in their last bits there (tests/kernels/test_token_draw.py measures by how much).

``python -m kernels.triton.token_draw`` compiles every variant for sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.reference import (
    NOISE_KEY_DOMAINS,
    NOISE_MIX_MULTIPLIERS,
    NOISE_MIX_SHIFTS,
    UNIFORM_BELOW_ONE,
    DrawRows,
)
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import compile_offline, has_cubin, pointers_and_strides, run_compile_check
from kernels.triton.storage import POINTER_TYPES, STORAGE_TYPES, interpreted, next_power_of_2

# Tokens per loop iteration: 4 warps × 32 lanes × 8 tokens.
BLOCK = 1024
# Tokens per program: Qwen3's 151,936-token vocabulary is 38 programs a row, so a lone row still
# spreads over a few dozen SMs while a batch of 64 fills the GPU many times over.
CHUNK = 4096
_NUM_WARPS = 4

_MULTIPLIER_1 = tl.constexpr(NOISE_MIX_MULTIPLIERS[0])
_MULTIPLIER_2 = tl.constexpr(NOISE_MIX_MULTIPLIERS[1])
_SHIFT_1 = tl.constexpr(NOISE_MIX_SHIFTS[0])
_SHIFT_2 = tl.constexpr(NOISE_MIX_SHIFTS[1])
_SHIFT_3 = tl.constexpr(NOISE_MIX_SHIFTS[2])
_DOMAIN_1 = tl.constexpr(NOISE_KEY_DOMAINS[0])
_DOMAIN_2 = tl.constexpr(NOISE_KEY_DOMAINS[1])
_BELOW_ONE = tl.constexpr(UNIFORM_BELOW_ONE)
_TWO_TO_MINUS_32 = tl.constexpr(2.0**-32)
_WORD_MASK = tl.constexpr(0xFFFFFFFF)


class TokenDrawError(ValueError):
    """An input the kernel cannot take; the message names the offending tensor, shape, dtype or device."""


@triton.jit
def _mix(words):
    """``kernels.reference.mix_words`` on uint32 words: the multiplications wrap mod 2**32."""
    words = words ^ (words >> _SHIFT_1)
    words = words * tl.full([], _MULTIPLIER_1, tl.uint32)
    words = words ^ (words >> _SHIFT_2)
    words = words * tl.full([], _MULTIPLIER_2, tl.uint32)
    return words ^ (words >> _SHIFT_3)


@triton.jit
def _row_key(seed_low, seed_high, step_low, DOMAIN: tl.constexpr):
    """One of ``kernels.reference.noise_row_keys`` (uint32 scalars in, a uint32 scalar out)."""
    state = _mix(seed_low ^ tl.full([], DOMAIN, tl.uint32))
    state = _mix(state ^ seed_high)
    return _mix(state ^ step_low)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.log(x)  # logf: what torch.log calls on CUDA
    else:  # the interpreter's log is numpy's
        return tl.log(x)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.exp(x)  # expf: what torch.exp calls on CUDA
    else:
        return tl.exp(x)


@triton.jit
def _log1p(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.log1p(x)  # log1pf: what torch.log1p calls on CUDA
    else:
        # The interpreter has no log1p. log(y) · x / (y − 1) with y = 1 + x cancels y's rounding
        # error to first order (a few ulps); where y rounds to 1, log1p(x) is x to fp32 precision.
        y = 1.0 + x
        shifted = y - 1.0
        safe = tl.where(shifted == 0.0, 1.0, shifted)
        return tl.where(shifted == 0.0, x, _log(y, LIBDEVICE) * tl.div_rn(x, safe))


@triton.jit
def _gumbel(token_ids, key_1, key_2, LIBDEVICE: tl.constexpr):
    """``kernels.reference.gumbel_noise`` for ``token_ids`` (int32) of the row keyed by ``key_1``/``key_2``."""
    words = _mix(token_ids.to(tl.uint32) ^ key_1)
    words = _mix(words ^ key_2)
    uniform = tl.minimum((words.to(tl.float32) + 0.5) * _TWO_TO_MINUS_32, _BELOW_ONE)
    exponential = -_log1p(-uniform, LIBDEVICE)
    return -_log(exponential, LIBDEVICE)


@triton.jit
def _token_draw_kernel(
    logits_ptr,
    keep_ptr,
    row_max_ptr,
    temperature_ptr,
    min_p_ptr,
    greedy_ptr,
    seed_ptr,
    step_ptr,
    best_score_ptr,
    best_token_ptr,
    scores_ptr,
    vocab,
    chunks,
    stride_logits,
    stride_keep,
    stride_scores,
    HAS_KEEP: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    WRITE_SCORES: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    first = chunk * CHUNK
    last = tl.minimum(first + CHUNK, vocab)
    row_logits = logits_ptr + row * stride_logits

    # Per lane, the best score so far and its token; a lane sees increasing token ids, so a strict
    # ">" keeps the lowest id among its ties. Starting from (-inf, the lane's first token) makes a
    # chunk whose every score is -inf answer its first token, as argmax does.
    best_score = tl.full([BLOCK], float("-inf"), tl.float32)
    best_token = first + lanes

    if tl.load(greedy_ptr + row) != 0:
        for start in range(first, last, BLOCK):
            tokens = start + lanes
            score = tl.load(row_logits + tokens, mask=tokens < last, other=float("-inf")).to(tl.float32)
            better = score > best_score
            best_score = tl.where(better, score, best_score)
            best_token = tl.where(better, tokens, best_token)
            if WRITE_SCORES:
                tl.store(scores_ptr + row * stride_scores + tokens, score, mask=tokens < last)
    else:
        temperature = tl.load(temperature_ptr + row)
        seed = tl.load(seed_ptr + row)
        seed_low = (seed & _WORD_MASK).to(tl.uint32)
        # Arithmetic shift then mask: the high word's bits for negative seeds too.
        seed_high = ((seed >> 32) & _WORD_MASK).to(tl.uint32)
        step_low = (tl.load(step_ptr + row) & _WORD_MASK).to(tl.uint32)
        key_1 = _row_key(seed_low, seed_high, step_low, _DOMAIN_1)
        key_2 = _row_key(seed_low, seed_high, step_low, _DOMAIN_2)
        if HAS_MIN_P:
            min_p = tl.load(min_p_ptr + row)
            scaled_max = tl.div_rn(tl.load(row_max_ptr + row), temperature)
        for start in range(first, last, BLOCK):
            tokens = start + lanes
            inside = tokens < last
            raw = tl.load(row_logits + tokens, mask=inside, other=float("-inf")).to(tl.float32)
            scaled = tl.div_rn(raw, temperature)
            allowed = inside
            if HAS_MIN_P:
                relative = _exp(scaled - scaled_max, LIBDEVICE)
                # min_p <= 0 is off exactly: even a NaN relative (an infinite row) stays allowed.
                allowed = allowed & tl.where(min_p > 0.0, relative >= min_p, inside)
            if HAS_KEEP:
                kept = tl.load(keep_ptr + row * stride_keep + tokens, mask=inside, other=0)
                allowed = allowed & (kept != 0)
            noisy = scaled + _gumbel(tokens, key_1, key_2, LIBDEVICE)
            score = tl.where(allowed, noisy, float("-inf"))
            better = score > best_score
            best_score = tl.where(better, score, best_score)
            best_token = tl.where(better, tokens, best_token)
            if WRITE_SCORES:
                tl.store(scores_ptr + row * stride_scores + tokens, score, mask=inside)

    top = tl.max(best_score, axis=0)
    # Lanes past the vocabulary hold ids >= vocab and score -inf: any real token ties them lower.
    token = tl.min(tl.where(best_score == top, best_token, 2147483647), axis=0)
    tl.store(best_score_ptr + row * chunks + chunk, top)
    tl.store(best_token_ptr + row * chunks + chunk, token)


@triton.jit
def _token_draw_finish_kernel(best_score_ptr, best_token_ptr, out_ptr, chunks, CHUNKS_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, CHUNKS_BLOCK)
    inside = index < chunks
    score = tl.load(best_score_ptr + row * chunks + index, mask=inside, other=float("-inf"))
    token = tl.load(best_token_ptr + row * chunks + index, mask=inside, other=2147483647)
    top = tl.max(score, axis=0)
    # Chunk c holds lower ids than chunk c + 1, so the lowest id among the best chunks is the row's.
    tl.store(out_ptr + row, tl.min(tl.where(score == top, token, 2147483647), axis=0).to(tl.int64))


def _check(
    logits: torch.Tensor,
    rows: DrawRows,
    keep: torch.Tensor | None,
    out: torch.Tensor | None,
    scores: torch.Tensor | None,
) -> None:
    rows.check(logits)
    if logits.dtype not in STORAGE_TYPES:
        raise TokenDrawError(f"logits dtype {logits.dtype}: must be bf16, fp16 or fp32")
    if logits.device.type != "cuda" and not interpreted():
        raise TokenDrawError(
            f"logits device {logits.device}: the Triton draw needs CUDA (or TRITON_INTERPRET=1)"
        )
    if logits.stride(1) != 1:
        raise TokenDrawError(f"logits stride {logits.stride()}: the vocabulary dim must be contiguous")
    if logits.shape[1] >= 2**31 - CHUNK:
        raise TokenDrawError(f"vocab {logits.shape[1]}: token ids must fit int32")
    for name in ("temperature", "min_p", "greedy", "seed", "step"):
        field = getattr(rows, name)
        if field.stride(0) != 1 and field.shape[0] > 1:
            raise TokenDrawError(f"rows.{name} stride {field.stride()}: must be contiguous")
    if keep is not None:
        if keep.shape != logits.shape or keep.dtype != torch.bool or keep.device != logits.device:
            raise TokenDrawError(
                f"keep is {tuple(keep.shape)} {keep.dtype} on {keep.device}: expected "
                f"{tuple(logits.shape)} bool on {logits.device}"
            )
        if keep.stride(1) != 1:
            raise TokenDrawError(f"keep stride {keep.stride()}: the vocabulary dim must be contiguous")
    if out is not None and (
        tuple(out.shape) != (logits.shape[0],)
        or out.dtype != torch.int64
        or out.device != logits.device
        or (out.stride(0) != 1 and out.shape[0] > 1)
    ):
        raise TokenDrawError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}: expected contiguous "
            f"({logits.shape[0]},) int64 on {logits.device}"
        )
    if scores is not None and (
        scores.shape != logits.shape
        or scores.dtype != torch.float32
        or scores.device != logits.device
        or scores.stride(1) != 1
    ):
        raise TokenDrawError(
            f"scores is {tuple(scores.shape)} {scores.dtype} on {scores.device}: expected "
            f"{tuple(logits.shape)} float32 on {logits.device}, vocabulary dim contiguous"
        )


_token_draw_launch = FastLaunch(_token_draw_kernel)
_token_draw_finish_launch = FastLaunch(_token_draw_finish_kernel)


def token_draw(
    logits: torch.Tensor,
    rows: DrawRows,
    keep: torch.Tensor | None = None,
    *,
    min_p: bool = True,
    out: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """``reference.draw_tokens(logits, rows, keep)``: int64 ``[rows]`` (written into ``out`` when given).

    ``min_p=False`` skips the filter and the row-maximum pass: right only when no row has min-p on
    (a row with ``min_p <= 0`` gets the same token either way). ``scores``, a diagnostic: float32
    ``[rows, vocab]`` receives every token's score as the argmax saw it (``-inf`` where filtered).
    ``chunk`` (a multiple of ``BLOCK``) changes only the launch geometry, never a token.
    """
    _check(logits, rows, keep, out, scores)
    if chunk < BLOCK or chunk % BLOCK:
        raise TokenDrawError(f"chunk={chunk}: must be a positive multiple of BLOCK={BLOCK}")
    num_rows, vocab = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    # The raw row maximum: exact in any reduction order, so batch-invariant.
    row_max = logits.amax(dim=-1).float() if min_p else None
    chunks = ceil_div(vocab, chunk)
    best_score = torch.empty(num_rows, chunks, dtype=torch.float32, device=logits.device)
    best_token = torch.empty(num_rows, chunks, dtype=torch.int32, device=logits.device)
    _token_draw_launch[(num_rows, chunks)](
        logits,
        keep,
        row_max,
        rows.temperature,
        rows.min_p,
        rows.greedy,
        rows.seed,
        rows.step,
        best_score,
        best_token,
        scores,
        vocab,
        chunks,
        logits.stride(0),
        0 if keep is None else keep.stride(0),
        0 if scores is None else scores.stride(0),
        HAS_KEEP=keep is not None,
        HAS_MIN_P=min_p,
        WRITE_SCORES=scores is not None,
        BLOCK=BLOCK,
        CHUNK=chunk,
        LIBDEVICE=not interpreted(),
        num_warps=_NUM_WARPS,
        enable_fp_fusion=False,  # every add and multiply rounded on its own, as torch's are
        enable_reflect_ftz=False,  # libdevice keeps subnormals, as torch's CUDA kernels do
    )
    _token_draw_finish_launch[(num_rows,)](
        best_score, best_token, out, chunks, CHUNKS_BLOCK=next_power_of_2(chunks), num_warps=1
    )
    return out


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)


def compile_variants(dtype: torch.dtype, *, has_keep: bool, has_min_p: bool, arch: int = 90) -> list[object]:
    """The draw kernel for one variant and the finishing kernel, compiled (cubin included) for
    ``sm_{arch}`` without a GPU, as the JIT specialises them at serving shapes."""
    constexprs: dict[str, object] = {
        "HAS_KEEP": has_keep,
        "HAS_MIN_P": has_min_p,
        "WRITE_SCORES": False,
        "BLOCK": BLOCK,
        "CHUNK": CHUNK,
        "LIBDEVICE": True,
        "scores_ptr": None,
        "stride_scores": 0,
    }
    if not has_keep:
        constexprs.update(keep_ptr=None, stride_keep=0)
    if not has_min_p:
        constexprs["row_max_ptr"] = None
    pointer_types = {
        "logits_ptr": POINTER_TYPES[dtype],
        "keep_ptr": "*i1",
        "row_max_ptr": "*fp32",
        "temperature_ptr": "*fp32",
        "min_p_ptr": "*fp32",
        "greedy_ptr": "*i64",
        "seed_ptr": "*i64",
        "step_ptr": "*i64",
        "best_score_ptr": "*fp32",
        "best_token_ptr": "*i32",
    }
    # Buffers are 16-byte aligned and the vocabulary strides multiples of 16 at serving shapes.
    draw = compile_offline(
        _token_draw_kernel,
        constexprs,
        lambda name: pointer_types.get(name, "i32"),
        pointers_and_strides(_token_draw_kernel),
        arch=arch,
        num_warps=_NUM_WARPS,
        enable_fp_fusion=False,
        enable_reflect_ftz=False,
    )
    finish_types = {"best_score_ptr": "*fp32", "best_token_ptr": "*i32", "out_ptr": "*i64", "chunks": "i32"}
    finish = compile_offline(
        _token_draw_finish_kernel,
        {"CHUNKS_BLOCK": 64},  # 64 chunks covers vocabularies up to 262,144 tokens (Gemma's)
        finish_types.__getitem__,
        arch=arch,
        num_warps=1,
        enable_fp_fusion=False,
    )
    return [draw, finish]


def main() -> int:
    for dtype in POINTER_TYPES:
        for has_keep in (False, True):
            for has_min_p in (False, True):
                for kernel in compile_variants(dtype, has_keep=has_keep, has_min_p=has_min_p):
                    if not has_cubin(kernel):
                        raise RuntimeError(f"no cubin for {dtype} keep={has_keep} min_p={has_min_p}")
                print(f"compiled token draw {dtype} keep={has_keep} min_p={has_min_p}")
    return 0


if __name__ == "__main__":
    run_compile_check(main)
