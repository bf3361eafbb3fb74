"""A prefill (varlen) step of the GDN causal conv with SiLU, reading and then writing the conv state
pool in place: one launch for the whole packed batch.

``kernels.reference.causal_conv1d`` over rows back to back in ``x [T, D]``: a row's inputs are its
slot's W − 1 stored inputs (zeros for a fresh row, whose slot is not read) followed by its tokens;
``y = R(silu(R(Σ_j w[:, j] · x_j)))`` with the products and their sum in fp32, added in the spec's
order (j = 0 … W − 1, each product rounded, no FMA), so the sum is the spec's bit for bit and the only
freedom left is the last bit of fp32 ``exp`` inside the SiLU (the step kernel, gdn_conv_step.py, is
the one-token form of the same sum). The slot then holds the row's last W − 1 inputs, which are
history rows where the row has fewer than W − 1 tokens (a zero-length row keeps its history, or
gets zeros when fresh).

The grid is (token blocks, channel blocks). Each row owns ``max(1, ⌈L / BLOCK_T⌉)`` blocks of
``BLOCK_T`` of its own tokens, starting at its first token, so no block spans two rows; a program
finds its row by a binary search over the rows' first blocks (``VarlenRows``, on the device), and a
row's bits depend on its tokens, weights and history alone, never on the batch or where it sits.

The in-place state write. Only a token among a row's first W − 1 reads history, and those tokens
lie in the row's first block (``BLOCK_T ≥ W − 1``): the program of (first block, channel block) is
the only one that reads the slot's channels, and it is the one that writes them. It does so after a
CTA barrier that follows all its conv loads, loads the final inputs (x rows and, for a short row,
history rows) and writes them after a second barrier, since the thread that stores a slot row is
not in general the one that loaded it. Slots must be distinct except for the padding slot 0, which
nothing reads. One launch after ``varlen_rows``' copy of the boundaries; no host synchronisation.

``python -m kernels.triton.gdn_conv_varlen`` compiles every variant for sm_90 without a GPU.
docs/kernels.md, "Gated DeltaNet", tells where it runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.kv_layout import ceil_div
from kernels.reference import check_cu_seqlens
from kernels.triton.gated_act import _silu
from kernels.triton.gdn_conv_step import (
    SERVING_WIDTHS,
    WIDTHS,
    GDNConvError,
    check_conv_inputs,
    compile_conv_kernel,
)
from kernels.triton.launch import FastLaunch
from kernels.triton.offline import check_variants, run_compile_check
from kernels.triton.prep_kernel import _round_to_storage
from kernels.triton.storage import STORAGE_TYPES, interpreted, next_power_of_2

# A program's tile: 32 tokens × 128 channels over 4 warps (32 fp32 accumulators a thread). Not tuned
# on a GPU yet. A row's first block must hold every token that reads history: BLOCK_T ≥ W − 1.
BLOCK_T = 32
BLOCK_D = 128
NUM_WARPS = 4
assert max(WIDTHS) - 1 <= BLOCK_T, "a row's first block must hold every token that reads history"


@dataclass(frozen=True, slots=True)
class VarlenRows:
    """The rows' boundaries as the kernel reads them: ``bounds`` int64 ``[2, N + 1]`` on the device,
    row 0 ``cu_seqlens`` (each row's first token), row 1 each row's first token block (a row owns
    ``max(1, ⌈L / BLOCK_T⌉)`` blocks, so they strictly increase); ``blocks`` the grid's token blocks,
    ``search_steps`` the binary search's ⌈log₂ N⌉ halvings."""

    bounds: torch.Tensor
    sequences: int
    tokens: int
    blocks: int
    search_steps: int


def varlen_rows(cu_seqlens: Sequence[int], device: torch.device) -> VarlenRows:
    """``cu_seqlens`` (host) → the kernel's ``VarlenRows`` on ``device``: one copy from pinned host
    memory (torch's caching host allocator keeps the block until the copy is done), which waits for
    nothing. The tensor is allocated on the current stream, where the kernel then reads it."""
    tokens = cu_seqlens[-1] if cu_seqlens else 0
    check_cu_seqlens(cu_seqlens, tokens)
    first_blocks = [0]
    for start, end in itertools.pairwise(cu_seqlens):
        first_blocks.append(first_blocks[-1] + max(1, ceil_div(end - start, BLOCK_T)))
    host = torch.tensor([list(cu_seqlens), first_blocks], dtype=torch.int64, pin_memory=device.type == "cuda")
    sequences = len(cu_seqlens) - 1
    return VarlenRows(
        bounds=host.to(device, non_blocking=True),
        sequences=sequences,
        tokens=tokens,
        blocks=first_blocks[-1],
        search_steps=(sequences - 1).bit_length(),
    )


@triton.jit
def _gdn_conv_varlen_kernel(
    x_ptr,
    w_ptr,
    bounds_ptr,
    slots_ptr,
    fresh_ptr,
    pool_ptr,
    y_ptr,
    sequences,
    search_steps,
    channels,
    total_tokens,
    split_a,
    split_b,
    stride_x_tok,
    stride_w_chan,
    stride_pool_slot,
    stride_pool_row,
    WIDTH: tl.constexpr,
    STORAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < channels
    first_blocks = bounds_ptr + sequences + 1

    # The row: the last whose first block is ≤ this block (first blocks strictly increase).
    lo = block * 0
    hi = lo + sequences
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        below = tl.load(first_blocks + mid) <= block
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    row = lo.to(tl.int64)
    start = tl.load(bounds_ptr + row)
    end = tl.load(bounds_ptr + row + 1)
    first = tl.load(first_blocks + row)
    tokens = start + (block - first) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tokens < end
    slot = tl.load(slots_ptr + row).to(tl.int64)
    fresh = tl.load(fresh_ptr + row)
    state = pool_ptr + slot * stride_pool_slot
    # A fresh row's slot is not read at all (the flag broadcast to a vector, as the interpreter
    # takes no scalar term in a mask).
    keep = (tl.zeros([BLOCK_T], dtype=tl.int32) + (fresh == 0).to(tl.int32)) != 0
    weights = w_ptr + cols * stride_w_chan

    # The sum starts from +0 as torch's does (an all-zero window sums to +0, whatever the weights' signs).
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        source = tokens - (WIDTH - 1) + j
        in_x = source >= start
        from_x = tl.load(
            x_ptr + source[:, None] * stride_x_tok + cols[None, :],
            mask=(tok_ok & in_x)[:, None] & col_ok[None, :],
            other=0.0,
        )
        held = tl.load(
            state + (source - start + (WIDTH - 1))[:, None] * stride_pool_row + cols[None, :],
            mask=(tok_ok & (source < start) & keep)[:, None] & col_ok[None, :],
            other=0.0,
        )
        value = tl.where(in_x[:, None], from_x, held).to(tl.float32)
        acc = acc + value * tl.load(weights + j, mask=col_ok).to(tl.float32)[None, :]

    conv = _round_to_storage(acc, STORAGE)
    y = _round_to_storage(_silu(conv, LIBDEVICE), STORAGE)
    # y is up to three pieces back to back, channels [0, a), [a, b), [b, D), each [T, width] dense;
    # a channel block lies in one piece (the boundaries are multiples of BLOCK_D).
    col0 = tl.program_id(1) * BLOCK_D
    piece_start = tl.where(col0 >= split_b, split_b, tl.where(col0 >= split_a, split_a, 0))
    piece_end = tl.where(col0 >= split_b, channels, tl.where(col0 >= split_a, split_b, split_a))
    piece_base = (start * 0 + piece_start) * total_tokens  # int64: T · D may pass 2³¹
    tl.store(
        y_ptr + piece_base + tokens[:, None] * (piece_end - piece_start) + (cols - piece_start)[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=tok_ok[:, None] & col_ok[None, :],
    )

    if block == first:
        # Every read of this slot's channels (the loads above, in this program only) is done before
        # any thread writes it.
        tl.debug_barrier()
        places = tl.arange(0, BLOCK_S)
        place_ok = places < WIDTH - 1
        keep_state = (tl.zeros([BLOCK_S], dtype=tl.int32) + (fresh == 0).to(tl.int32)) != 0
        # Slot row i takes input L + i of [history (W − 1 rows) | the row's L tokens].
        index = (end - start) + places
        final_in_x = index >= WIDTH - 1
        final_x = tl.load(
            x_ptr + (start + index - (WIDTH - 1))[:, None] * stride_x_tok + cols[None, :],
            mask=(place_ok & final_in_x)[:, None] & col_ok[None, :],
            other=0.0,
        )
        final_held = tl.load(
            state + index[:, None] * stride_pool_row + cols[None, :],
            mask=(place_ok & (index < WIDTH - 1) & keep_state)[:, None] & col_ok[None, :],
            other=0.0,
        )
        final = tl.where(final_in_x[:, None], final_x, final_held)
        tl.debug_barrier()
        tl.store(
            state + places[:, None] * stride_pool_row + cols[None, :],
            final,
            mask=place_ok[:, None] & col_ok[None, :],
        )


_gdn_conv_varlen_launch = FastLaunch(_gdn_conv_varlen_kernel)


def gdn_conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    rows: VarlenRows,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    conv_pool: torch.Tensor,
) -> torch.Tensor:
    """Rows back to back: ``x [T, D]`` (a strided row view is fine), ``weight [D, W]``, ``rows``
    from ``varlen_rows``, ``slots [N]`` int64, ``fresh [N]`` bool, ``conv_pool [slots, W − 1, D]`` in
    x's dtype, each row's slot written with its last W − 1 inputs. Returns ``y [T, D]`` in x's dtype,
    contiguous."""
    (y,) = gdn_conv_varlen_pieces(x, weight, rows, slots, fresh, conv_pool, ())
    return y


def pieces_fit(widths: Sequence[int]) -> bool:
    """Whether ``gdn_conv_varlen_pieces`` can write pieces of these widths each contiguous: at most
    three, every boundary on a channel block's edge."""
    return len(widths) <= 3 and all(w % BLOCK_D == 0 for w in widths[:-1])


def gdn_conv_varlen_pieces(
    x: torch.Tensor,
    weight: torch.Tensor,
    rows: VarlenRows,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    conv_pool: torch.Tensor,
    widths: Sequence[int],
) -> tuple[torch.Tensor, ...]:
    """``gdn_conv_varlen`` with ``y`` cut along channels into pieces of ``widths`` (summing to D;
    empty: one piece), each ``[T, width]`` and contiguous, back to back in one buffer: what a
    consumer that needs dense q, k and v reads without a copy. ``pieces_fit(widths)`` must hold."""
    channels, width = check_conv_inputs(x, weight, slots, fresh, conv_pool)
    device = conv_pool.device
    if x.shape[0] != rows.tokens or slots.shape[0] != rows.sequences:
        raise GDNConvError(
            f"x has {x.shape[0]} tokens and slots {slots.shape[0]} rows; the rows' boundaries count "
            f"{rows.tokens} tokens in {rows.sequences} rows"
        )
    if rows.bounds.device != device:
        raise GDNConvError(
            f"the rows' boundaries are on {rows.bounds.device}, the conv state pool on {device}"
        )
    widths = tuple(widths) or (channels,)
    if sum(widths) != channels or not pieces_fit(widths):
        raise GDNConvError(
            f"pieces of widths {list(widths)}: must sum to the {channels} channels, at most three, "
            f"every boundary a multiple of {BLOCK_D}"
        )
    split_a = widths[0] if len(widths) > 1 else channels
    split_b = split_a + widths[1] if len(widths) > 2 else channels
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(rows.tokens * channels, dtype=x.dtype, device=device)
    _gdn_conv_varlen_launch[(rows.blocks, ceil_div(channels, BLOCK_D))](
        x,
        weight,
        rows.bounds,
        slots,
        fresh.view(torch.uint8),  # a byte per row: the interpreter takes no bool mask from a bool load
        conv_pool,
        out,
        rows.sequences,
        rows.search_steps,
        channels,
        rows.tokens,
        split_a,
        split_b,
        x.stride(0),
        weight.stride(0),
        conv_pool.stride(0),
        conv_pool.stride(1),
        **_constexprs(width, x.dtype),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # every product and sum rounded on its own, as the spec's torch ops
    )
    offsets = [0, *itertools.accumulate(widths)]
    return tuple(
        out[rows.tokens * a : rows.tokens * b].view(rows.tokens, b - a)
        for a, b in itertools.pairwise(offsets)
    )


def _constexprs(width: int, dtype: torch.dtype) -> dict[str, object]:
    return {
        "WIDTH": width,
        "STORAGE": STORAGE_TYPES[dtype],
        "BLOCK_T": BLOCK_T,
        "BLOCK_D": BLOCK_D,
        "BLOCK_S": next_power_of_2(width - 1),
        "LIBDEVICE": not interpreted(),
    }


# ------------------------------------------------------------------ ahead-of-time compile (sm_90)


def compile_variant(width: int, dtype: torch.dtype, arch: int = 90) -> object:
    """The compiled kernel (cubin included) for one variant on ``sm_{arch}``, without a GPU."""
    return compile_conv_kernel(_gdn_conv_varlen_kernel, _constexprs(width, dtype), dtype, arch, NUM_WARPS)


def main() -> int:
    return check_variants("gdn_conv_varlen", "W", SERVING_WIDTHS, compile_variant)


if __name__ == "__main__":
    run_compile_check(main)
