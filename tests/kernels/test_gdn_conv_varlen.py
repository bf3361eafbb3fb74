"""The varlen GDN conv (kernels/triton/gdn_conv_varlen.py) against the spec and against itself, and
the backends' conv (kernels/gdn/triton_conv.py) against the torch form.

Runs on the GPU when there is one, otherwise under Triton's interpreter (tests/kernels/conftest.py).
Spec anchor: ``reference.causal_conv1d`` with each row's history (zeros where fresh). The kernel's fp32
sum is the spec's bit for bit, so what may differ is the last bit of exp inside the SiLU: the slot
states (copies of inputs) are asserted bit for bit, and so are bf16 outputs on the interpreter; fp32
outputs within ``CONV_FP32_ULPS``. The rest is metamorphic and bit-exact: a row first and behind
other rows, two runs, fresh rows against dirty slots, sentinel slots untouched.

Shapes: 160 channels (two channel blocks, the second masked), x a column view of a wider buffer whose
extra columns are NaN (a read past the view would show), rows of 0-130 tokens (one to five 32-token
blocks, rows shorter than W − 1 that keep part of their history).
"""

from __future__ import annotations

import logging

import pytest
import torch
from sm90_compile import compiled_variants

from kernels import reference
from kernels.gdn.base import StateRows
from kernels.gdn.torch_backend import TorchGDN
from kernels.gdn.triton_conv import TritonConv
from kernels.triton.gdn_conv_step import SERVING_WIDTHS, GDNConvError
from kernels.triton.gdn_conv_varlen import BLOCK_D, gdn_conv_varlen, gdn_conv_varlen_pieces, varlen_rows
from kernels.triton.storage import interpreted

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CHANNELS = 160
SLOTS = 16
# fp32 outputs: the spec's sum bit for bit, then SiLU, whose exp may differ in its last bit. Measured
# under the interpreter (2026-12-05, seeds 1-5 × widths 2-4 of this batch): about 17% of the elements
# differ, by at most 4 fp32 ulps (in 2 of the 15 cases; 2-3 in the others), near SiLU's minimum. All
# of it is exp's: the spec's sum put through SiLU with numpy's exp (the interpreter's) gave the
# kernel's outputs bit for bit.
CONV_FP32_ULPS = 4
# On a GPU, libdevice's exp against the spec's: at most this share of bf16 elements may sit one
# rounding away (the interpreter's figure is 0), as tests/kernels/test_gdn_decode_mixer.py allows.
GPU_FLIP_SHARE = 0.01
# The batch: every length the block boundaries make interesting, and two empty rows (one fresh).
LENGTHS = (1, 2, 3, 4, 5, 63, 64, 65, 130, 0, 0)
ROW_SLOTS = (9, 3, 14, 1, 7, 12, 4, 10, 2, 6, 13)
FRESH = (False, True, False, True, False, False, True, False, False, True, False)


def _bounds(lengths: tuple[int, ...]) -> tuple[int, ...]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def _x(tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[tokens, CHANNELS]``, a column view of a buffer with two NaN columns past it."""
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.full((tokens, CHANNELS + 2), float("nan"))
    buffer[:, :CHANNELS] = torch.randn(tokens, CHANNELS, generator=gen)
    return buffer.to(dtype).to(DEVICE)[:, :CHANNELS]


def _weight(dtype: torch.dtype, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(CHANNELS, width, generator=gen)).to(dtype).to(DEVICE)


def _pool(dtype: torch.dtype, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SLOTS, width - 1, CHANNELS, generator=gen).to(dtype).to(DEVICE)


def _rows(slots: tuple[int, ...], fresh: tuple[bool, ...], cu: tuple[int, ...] | None) -> StateRows:
    return StateRows(
        torch.tensor(slots, dtype=torch.int64, device=DEVICE), torch.tensor(fresh, device=DEVICE), cu
    )


def _initial(pool: torch.Tensor, rows: StateRows) -> torch.Tensor:
    keep = (~rows.fresh).view(-1, 1, 1)
    return torch.where(keep, pool[rows.slots], torch.zeros((), dtype=pool.dtype, device=pool.device))


def _varlen(x: torch.Tensor, weight: torch.Tensor, rows: StateRows, pool: torch.Tensor) -> torch.Tensor:
    assert rows.cu_seqlens is not None
    return gdn_conv_varlen(x, weight, varlen_rows(rows.cu_seqlens, DEVICE), rows.slots, rows.fresh, pool)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in fp32 ulps between two fp32 tensors of one sign pattern."""
    ai = a.float().cpu().view(torch.int32).long()
    bi = b.float().cpu().view(torch.int32).long()
    return int((ai - bi).abs().max())


def _check_outputs(got: torch.Tensor, want: torch.Tensor) -> None:
    """The spec's outputs up to exp's last bit (module doc)."""
    if got.dtype == torch.float32:
        ulps = _ulps(got, want)
        print(f"fp32 outputs: at most {ulps} ulps from the spec")
        assert ulps <= CONV_FP32_ULPS
        return
    differing = int((got != want).sum())
    if interpreted():
        assert differing == 0, f"{differing} of {got.numel()} {got.dtype} elements differ from the spec"
    else:
        assert differing <= GPU_FLIP_SHARE * got.numel(), (differing, got.numel())


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=("fp32", "bf16"))
def test_varlen_conv_is_the_spec_with_each_slot_written(dtype: torch.dtype, width: int) -> None:
    cu = _bounds(LENGTHS)
    x = _x(cu[-1], dtype, seed=1)
    weight = _weight(dtype, width, seed=2)
    pool = _pool(dtype, width, seed=3)
    rows = _rows(ROW_SLOTS, FRESH, cu)
    initial = _initial(pool, rows)
    want_y, want_state = reference.causal_conv1d(x, weight, cu, initial)
    outside = [s for s in range(SLOTS) if s not in ROW_SLOTS]  # the padding slot 0 among them
    untouched = pool[outside].clone()
    got = _varlen(x, weight, rows, pool)
    assert got.dtype == dtype and got.shape == (cu[-1], CHANNELS) and got.is_contiguous()
    # Each slot holds its row's last W − 1 inputs, the spec's bit for bit: for rows shorter than
    # W − 1 part of the history (zeros where fresh), for empty rows all of it.
    assert torch.equal(pool[rows.slots], want_state)
    assert torch.equal(pool[outside], untouched)
    _check_outputs(got, want_y)
    # Against the fp64 oracle, no worse than the spec itself (the sum is the spec's; exp's last bit
    # moves an fp32 output by at most CONV_FP32_ULPS, far below the two roundings' error).
    oracle_y, _ = reference.causal_conv1d(
        x.double(), weight.double(), cu, initial.double(), accumulate=torch.float64
    )
    spec_err = float((want_y.double() - oracle_y).abs().max())
    got_err = float((got.double() - oracle_y).abs().max())
    print(f"error against fp64: kernel {got_err:.3g}, spec {spec_err:.3g}")
    assert got_err <= spec_err * (1 + 1e-6)


def test_a_row_has_the_same_bits_first_and_behind_other_rows_and_across_runs() -> None:
    dtype, width = torch.bfloat16, 4
    weight = _weight(dtype, width, seed=4)
    row = _x(65, dtype, seed=5)
    others = _x(2 + 130, dtype, seed=6)
    pool = _pool(dtype, width, seed=7)
    alone_pool, behind_pool = pool.clone(), pool.clone()
    alone = _varlen(row, weight, _rows((5,), (False,), (0, 65)), alone_pool)
    packed = torch.cat([others, row])
    behind = _varlen(packed, weight, _rows((8, 11, 5), (True, False, False), (0, 2, 132, 197)), behind_pool)
    assert torch.equal(alone, behind[132:])
    assert torch.equal(alone_pool[5], behind_pool[5])
    # Slots neither call wrote keep their bits.
    outside = [s for s in range(SLOTS) if s not in (5, 8, 11)]
    assert torch.equal(alone_pool[outside], pool[outside])
    assert torch.equal(behind_pool[outside], pool[outside])
    again_pool = pool.clone()
    again = _varlen(packed, weight, _rows((8, 11, 5), (True, False, False), (0, 2, 132, 197)), again_pool)
    assert torch.equal(again, behind) and torch.equal(again_pool, behind_pool)


def test_fresh_rows_ignore_what_their_slot_holds() -> None:
    dtype, width = torch.bfloat16, 4
    cu = (0, 2, 0 + 2 + 70)
    x = _x(cu[-1], dtype, seed=8)
    weight = _weight(dtype, width, seed=9)
    rows = _rows((1, 2), (True, True), cu)
    clean = torch.zeros(3, width - 1, CHANNELS, dtype=dtype, device=DEVICE)
    dirty = _pool(dtype, width, seed=10)[:3].clone()
    dirty[0] = 0
    first = _varlen(x, weight, rows, clean)
    second = _varlen(x, weight, rows, dirty)
    assert torch.equal(first, second) and torch.equal(clean, dirty)
    # The 2-token fresh row keeps one zero history row before its tokens.
    assert not clean[1, 0].any() and torch.equal(clean[1, 1:], x[:2])
    assert torch.equal(clean[2], x[72 - 3 :])


def test_refusals_name_the_input() -> None:
    dtype, width = torch.bfloat16, 4
    cu = (0, 3, 5)
    x = _x(5, dtype, seed=11)
    weight = _weight(dtype, width, seed=12)
    pool = _pool(dtype, width, seed=13)
    rows = _rows((1, 2), (False, False), cu)
    bounds = varlen_rows(cu, DEVICE)
    with pytest.raises(GDNConvError, match="x has 4 tokens and slots 2 rows; the rows' boundaries count 5"):
        gdn_conv_varlen(x[:4], weight, bounds, rows.slots, rows.fresh, pool)
    with pytest.raises(GDNConvError, match=r"conv_pool is torch\.float32, x torch\.bfloat16"):
        gdn_conv_varlen(x, weight, bounds, rows.slots, rows.fresh, pool.float())
    with pytest.raises(GDNConvError, match="conv width 5"):
        gdn_conv_varlen(x, _weight(dtype, 5, seed=12), bounds, rows.slots, rows.fresh, pool)
    with pytest.raises(GDNConvError, match="slots must be int64"):
        gdn_conv_varlen(x, weight, bounds, rows.slots.int(), rows.fresh, pool)
    with pytest.raises(reference.SpecError, match="cu_seqlens"):
        varlen_rows((0, 3, 2), DEVICE)


# -- pieces: q, k and v each dense ------------------------------------------------------------------

# Three pieces whose boundaries sit on channel blocks, the last block of the last piece masked, as
# Qwen3.5's q | k | v (2,048 | 2,048 | 4,096 at the 4B) are in miniature.
PIECES = (BLOCK_D, BLOCK_D, BLOCK_D + 32)


def _wide(tokens: int, channels: int, seed: int) -> torch.Tensor:
    """``[tokens, channels]`` bf16, a column view of a buffer whose extra columns are NaN."""
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.full((tokens, channels + 3), float("nan"))
    buffer[:, :channels] = torch.randn(tokens, channels, generator=gen)
    return buffer.bfloat16().to(DEVICE)[:, :channels]


def test_pieces_are_the_whole_output_cut_and_each_dense() -> None:
    """The same bits as the one-piece output, split along channels; each piece contiguous, all of
    them back to back in one buffer; the slots written the same."""
    channels, width = sum(PIECES), 4
    cu = _bounds(LENGTHS)
    x = _wide(cu[-1], channels, seed=40)
    gen = torch.Generator().manual_seed(41)
    weight = (0.5 * torch.randn(channels, width, generator=gen)).bfloat16().to(DEVICE)
    pool = torch.randn(SLOTS, width - 1, channels, generator=gen).bfloat16().to(DEVICE)
    rows = _rows(ROW_SLOTS, FRESH, cu)
    bounds = varlen_rows(cu, DEVICE)
    whole_pool, pieces_pool = pool.clone(), pool.clone()
    whole = gdn_conv_varlen(x, weight, bounds, rows.slots, rows.fresh, whole_pool)
    pieces = gdn_conv_varlen_pieces(x, weight, bounds, rows.slots, rows.fresh, pieces_pool, PIECES)
    assert [tuple(p.shape) for p in pieces] == [(cu[-1], w) for w in PIECES]
    assert all(p.is_contiguous() for p in pieces)
    base = pieces[0].data_ptr()
    size = pieces[0].element_size()
    assert [p.data_ptr() - base for p in pieces] == [
        0,
        cu[-1] * PIECES[0] * size,
        cu[-1] * 2 * PIECES[0] * size,
    ]
    for piece, expected in zip(pieces, whole.split(list(PIECES), dim=-1), strict=True):
        assert torch.equal(piece, expected)
    assert torch.equal(pieces_pool, whole_pool)


def test_pieces_that_do_not_fit_the_channel_blocks_are_refused_by_the_kernel() -> None:
    cu = (0, 3, 10)
    x = _x(cu[-1], torch.bfloat16, seed=42)
    weight = _weight(torch.bfloat16, 4, seed=43)
    rows = _rows((1, 2), (False, True), cu)
    bounds = varlen_rows(cu, DEVICE)
    pool = _pool(torch.bfloat16, 4, seed=44)
    for widths in ((100, 60), (BLOCK_D, 16), (32, 32, 32, 64)):
        with pytest.raises(GDNConvError, match="pieces of widths"):
            gdn_conv_varlen_pieces(x, weight, bounds, rows.slots, rows.fresh, pool, widths)


@pytest.mark.parametrize("decode", [False, True], ids=("prefill", "decode"))
@pytest.mark.parametrize("widths", [PIECES, (64, 64, sum(PIECES) - 128)], ids=("fit", "views"))
def test_backend_conv_pieces_are_the_torch_form_s(
    decode: bool, widths: tuple[int, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """``TritonConv.conv_pieces`` against ``TorchGDN.conv_pieces`` (views of its one output): the
    same values either way; dense pieces where a prefill's boundaries fit the channel blocks, and
    where they do not, views, said once."""
    channels, width = sum(PIECES), 4
    lengths = (1,) * len(ROW_SLOTS) if decode else LENGTHS
    cu = _bounds(lengths)
    x = _wide(cu[-1], channels, seed=45)
    gen = torch.Generator().manual_seed(46)
    weight = (0.5 * torch.randn(channels, width, generator=gen)).bfloat16().to(DEVICE)
    pool = torch.randn(SLOTS, width - 1, channels, generator=gen).bfloat16().to(DEVICE)
    rows = _rows(ROW_SLOTS, FRESH, None if decode else cu)
    torch_pool, triton_pool = pool.clone(), pool.clone()
    want = TorchGDN().conv_pieces(x, weight, rows, torch_pool, widths)
    conv = TritonConv()
    with caplog.at_level(logging.INFO, logger="infer.kernels.gdn"):
        got = conv.conv_pieces(x, weight, rows, triton_pool, widths)
        conv.conv_pieces(x, weight, rows, triton_pool.clone(), widths)
    assert torch.equal(triton_pool, torch_pool)
    for g, w in zip(got, want, strict=True):
        _check_outputs(g, w)
    assert all(p.is_contiguous() for p in got) == (not decode and widths == PIECES)
    said = [r for r in caplog.records if "off the kernel's channel blocks" in r.getMessage()]
    assert len(said) == (1 if not decode and widths != PIECES else 0)


# -- the backends' conv ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=("fp32", "bf16"))
@pytest.mark.parametrize("decode", [False, True], ids=("prefill", "decode"))
def test_backend_conv_is_the_torch_form(dtype: torch.dtype, decode: bool) -> None:
    """What the `fla` and `flashinfer` backends run (kernels/gdn/triton_conv.py) against
    ``TorchGDN.conv`` on the same inputs: states bit for bit, outputs up to exp's last bit."""
    width = 4
    lengths = (1,) * len(ROW_SLOTS) if decode else LENGTHS
    cu = _bounds(lengths)
    x = _x(cu[-1], dtype, seed=14)
    weight = _weight(dtype, width, seed=15)
    rows = _rows(ROW_SLOTS, FRESH, None if decode else cu)
    pool = _pool(dtype, width, seed=16)
    torch_pool, triton_pool = pool.clone(), pool.clone()
    want = TorchGDN().conv(x, weight, rows, torch_pool)
    got = TritonConv().conv(x, weight, rows, triton_pool)
    assert torch.equal(triton_pool, torch_pool)
    _check_outputs(got, want)


def test_a_steps_layers_copy_the_row_boundaries_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GDN layer of a step passes the same StateRows: the boundaries go to the device once a
    step, and a second layer's conv over them is the torch form's as the first is."""
    import kernels.gdn.triton_conv as triton_conv

    copies: list[tuple[int, ...]] = []
    real = triton_conv.varlen_rows

    def counted(cu: tuple[int, ...], device: torch.device) -> object:
        copies.append(tuple(cu))
        return real(cu, device)

    monkeypatch.setattr(triton_conv, "varlen_rows", counted)
    cu = _bounds(LENGTHS)
    rows = _rows(ROW_SLOTS, FRESH, cu)
    weights = [_weight(torch.bfloat16, 4, seed=s) for s in (30, 31)]
    x = _x(cu[-1], torch.bfloat16, seed=32)
    conv = TritonConv()
    pools = [_pool(torch.bfloat16, 4, seed=s) for s in (33, 34)]
    for weight, pool in zip(weights, pools, strict=True):
        want_pool = pool.clone()
        want = TorchGDN().conv(x, weight, rows, want_pool)
        _check_outputs(conv.conv(x, weight, rows, pool), want)
        assert torch.equal(pool, want_pool)
    assert copies == [tuple(cu)]
    conv.conv(x, weights[0], _rows(ROW_SLOTS, FRESH, cu), pools[0])  # the next step's rows
    assert len(copies) == 2


def test_backend_conv_runs_the_torch_form_for_a_width_the_kernels_refuse(
    caplog: pytest.LogCaptureFixture,
) -> None:
    width = 5
    cu = (0, 3, 10)
    x = _x(cu[-1], torch.bfloat16, seed=17)
    weight = _weight(torch.bfloat16, width, seed=18)
    rows = _rows((1, 2), (False, True), cu)
    pool = _pool(torch.bfloat16, width, seed=19)
    torch_pool, fallback_pool = pool.clone(), pool.clone()
    conv = TritonConv()
    with caplog.at_level(logging.INFO, logger="infer.kernels.gdn"):
        got = conv.conv(x, weight, rows, fallback_pool)
        conv.conv(x, weight, rows, fallback_pool.clone())
    want = TorchGDN().conv(x, weight, rows, torch_pool)
    assert torch.equal(got, want) and torch.equal(fallback_pool, torch_pool)
    logged = [r.getMessage() for r in caplog.records if "conv width 5" in r.getMessage()]
    assert len(logged) == 1, logged


def test_every_variant_compiles_for_sm90() -> None:
    assert len(compiled_variants("kernels.triton.gdn_conv_varlen")) == len(SERVING_WIDTHS)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_serving_width_on_the_gpu_is_the_torch_form_and_row_invariant() -> None:
    """Qwen3.5-4B's conv (8192 channels, W = 4, bf16) over a 1,200-token varlen batch whose rows
    straddle the 32-token blocks: slot states the torch form's bit for bit (the in-place write
    behind the barrier), outputs within the GPU's exp flips, a row alone equal to it in the batch."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    channels, width = 8192, 4
    lengths = (1, 2, 31, 32, 33, 63, 64, 65, 900, 0, 9)
    cu = _bounds(lengths)
    x = torch.randn(cu[-1], channels, generator=gen, device=device).bfloat16()
    weight = (0.5 * torch.randn(channels, width, generator=gen, device=device)).bfloat16()
    pool = torch.randn(len(lengths) + 4, width - 1, channels, generator=gen, device=device).bfloat16()
    slots = tuple(range(2, len(lengths) + 2))
    fresh = tuple(n % 3 == 0 for n in range(len(lengths)))
    rows = StateRows(torch.tensor(slots, device=device), torch.tensor(fresh, device=device), cu)
    torch_pool, triton_pool = pool.clone(), pool.clone()
    want = TorchGDN().conv(x, weight, rows, torch_pool)
    got = TritonConv().conv(x, weight, rows, triton_pool)
    assert torch.equal(triton_pool, torch_pool)
    assert int((got != want).sum()) <= GPU_FLIP_SHARE * got.numel()
    row = 8  # the 900-token row, not fresh
    alone_pool = pool.clone()
    alone = TritonConv().conv(
        x[cu[row] : cu[row + 1]],
        weight,
        StateRows(rows.slots[row : row + 1], rows.fresh[row : row + 1], (0, lengths[row])),
        alone_pool,
    )
    assert torch.equal(alone, got[cu[row] : cu[row + 1]])
    assert torch.equal(alone_pool[slots[row]], triton_pool[slots[row]])
    # The model's q | k | v pieces (2,048 | 2,048 | 4,096), each dense: the same bits.
    pieces_pool = pool.clone()
    pieces = TritonConv().conv_pieces(x, weight, rows, pieces_pool, (2048, 2048, 4096))
    assert all(p.is_contiguous() for p in pieces)
    assert torch.equal(torch.cat(pieces, dim=-1), got) and torch.equal(pieces_pool, triton_pool)
