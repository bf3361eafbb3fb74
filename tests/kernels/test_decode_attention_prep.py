"""The split-KV decode attention's PREP variant (`decode_attention_with_prep`) against the unfused
pair it replaces and against itself. Interpreter on a CPU, the GPU when one is present.

Against the pair, bit for bit: `attention_prep` then `decode_attention` on one copy of the pool,
the fused launch on another; the outputs and the whole pools (every layer, every page) must be
identical afterwards, so the new K/V landed in the same slots with the same bits. The pair is
itself checked against the spec (tests/kernels/test_prep_kernel_small.py,
tests/kernels/test_decode_attention.py). Against itself: a row alone and inside a batch; pool
entries no row references (NaN sentinels) untouched. Small head dims, head counts and a 16-token
split keep the interpreter fast while reaching every split case: kv_len 1, a split boundary, more
splits than a KV head has programs.
"""

from __future__ import annotations

import pytest
import torch

from gates.harness.prep_parity import bit_identical
from kernels.attention.base import AttentionLayerSpec
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE, KVPoolLayout, pages_for
from kernels.reference import (
    NormWeight,
    PagedRows,
    PrepSpec,
    gemma3_prep,
    gemma4_global_prep,
    gemma4_sliding_prep,
    qwen3_prep,
    qwen35_full_attention_prep,
    rope_table,
)
from kernels.triton.attention_prep import attention_prep
from kernels.triton.decode_attention import (
    PROGRAMS_PER_HEAD,
    DecodeAttentionError,
    PrepOperands,
    decode_attention,
    decode_attention_with_prep,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPLIT = 16  # the smallest split: a few tokens reach every split case
# kv_len 1, a page, a split boundary (SPLIT, SPLIT + 1), several splits, and past the programs
# (each program of a KV head then folds two or more splits).
KV_LENS = (1, 5, SPLIT, SPLIT + 1, 3 * SPLIT + 7, PROGRAMS_PER_HEAD * SPLIT + 9)


class Case:
    """A pure decode step: row i is one token of its own sequence at position kv_lens[i] - 1,
    whose pages (shuffled, none shared) hold the earlier positions. Q/K/V are views of one fused
    projection; the pool has two layers (the step writes the second) and spare pages no row owns."""

    def __init__(
        self,
        spec: PrepSpec,
        heads: int,
        kv_heads: int,
        kv_lens: tuple[int, ...],
        dtype: torch.dtype,
        *,
        window: int | None = None,
        seed: int = 0,
        pv_storage: bool = False,
    ):
        g = torch.Generator().manual_seed(seed)
        d = spec.head_dim
        self.spec, self.kv_lens, self.dtype, self.pv_storage = spec, kv_lens, dtype, pv_storage
        self.layer = AttentionLayerSpec(heads, kv_heads, d, d**-0.5, window)
        rows = len(kv_lens)
        pages = 1 + sum(pages_for(n) for n in kv_lens) + 3  # the padding page and three spare ones
        self.pool = torch.randn(KVPoolLayout(2, pages, kv_heads, d).shape, generator=g).to(dtype).to(DEVICE)
        order = (torch.randperm(pages - 1, generator=g) + 1).tolist()
        self.tables: list[list[int]] = []
        for n in kv_lens:
            self.tables.append(order[: pages_for(n)])
            order = order[pages_for(n) :]
        width = heads + kv_heads * (2 if spec.takes_v else 1)
        # A scale per head so rounding is exercised across exponents.
        scales = torch.exp2(torch.randint(-3, 4, (1, width, 1), generator=g).float())
        self.qkv = (torch.randn(rows, width, d, generator=g) * scales).to(dtype).to(DEVICE)
        self.q_norm_weight = self._norm_weight(spec.q_norm.weight, g)
        self.k_norm_weight = self._norm_weight(spec.k_norm.weight, g)
        self.rope_table = rope_table(spec.rope, max(kv_lens) + 8, dtype, DEVICE)

    def _norm_weight(self, weight: NormWeight, g: torch.Generator) -> torch.Tensor:
        noise = 0.3 * torch.randn(self.spec.head_dim, generator=g)
        return (noise if weight is NormWeight.ONE_PLUS_W else 1.0 + noise).to(self.dtype).to(DEVICE)

    def operands(self, rows: list[int] | None = None) -> dict[str, object]:
        """The step's operands for the given rows (all by default), in that order."""
        rows = list(range(len(self.kv_lens))) if rows is None else rows
        layer, qkv = self.layer, self.qkv[rows]
        heads, kv_heads = layer.num_heads, layer.num_kv_heads
        width = max(len(self.tables[r]) for r in rows)
        table = torch.full((len(rows), width), PADDING_PAGE, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(self.tables[r])] = torch.tensor(self.tables[r], dtype=torch.int32)
        lens = torch.tensor([self.kv_lens[r] for r in rows], dtype=torch.int32)
        return {
            "q": qkv[:, :heads],
            "k": qkv[:, heads : heads + kv_heads],
            "v": qkv[:, heads + kv_heads :] if self.spec.takes_v else None,
            "page_table": table.to(DEVICE),
            "kv_lens": lens.to(DEVICE),
            "positions": (lens - 1).to(DEVICE),
        }

    def prep(self, positions: torch.Tensor) -> PrepOperands:
        return PrepOperands(self.spec, self.q_norm_weight, self.k_norm_weight, self.rope_table, positions)

    def unfused(self, pool: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """`attention_prep` then `decode_attention`, writing into `pool` (both layers)."""
        ops = self.operands(rows)
        q, k, v, table = ops["q"], ops["k"], ops["v"], ops["page_table"]
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(table, torch.Tensor)
        assert v is None or isinstance(v, torch.Tensor)
        positions, lens = ops["positions"], ops["kv_lens"]
        assert isinstance(positions, torch.Tensor) and isinstance(lens, torch.Tensor)
        seq_index = torch.arange(q.shape[0], dtype=torch.int32, device=DEVICE)
        q_rot = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
        attention_prep(
            self.spec,
            q,
            k,
            v,
            self.q_norm_weight,
            self.k_norm_weight,
            PagedRows(positions, seq_index, table),
            self.rope_table,
            pool[1],
            q_rot,
        )
        return decode_attention(
            q_rot, pool[1], table, lens, self.layer, split_tokens=SPLIT, pv_storage=self.pv_storage
        )

    def fused(self, pool: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        ops = self.operands(rows)
        q, k, v, table = ops["q"], ops["k"], ops["v"], ops["page_table"]
        positions, lens = ops["positions"], ops["kv_lens"]
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(table, torch.Tensor)
        assert v is None or isinstance(v, torch.Tensor)
        assert isinstance(positions, torch.Tensor) and isinstance(lens, torch.Tensor)
        return decode_attention_with_prep(
            self.prep(positions),
            q,
            k,
            v,
            pool[1],
            table,
            lens,
            self.layer,
            split_tokens=SPLIT,
            pv_storage=self.pv_storage,
        )

    def sentinel_pool(self) -> torch.Tensor:
        """The pool with NaN wherever no row may look: the first layer, spare pages, slots past each
        row's kv_len and positions before its window (the new token's slot keeps a stale value)."""
        seen = torch.zeros(self.pool.shape[1], PAGE_SIZE, dtype=torch.bool)
        for n, table in zip(self.kv_lens, self.tables, strict=True):
            start = 0 if self.layer.window is None else max(0, n - self.layer.window)
            for pos in range(start, n):
                seen[table[pos // PAGE_SIZE], pos % PAGE_SIZE] = True
        pool = self.pool.clone()
        pool[0] = float("nan")
        pool[1].transpose(1, 2)[~seen.to(DEVICE)] = float("nan")  # [pages, 16, 2, Hkv, D] view
        return pool


def assert_same_as_the_pair(case: Case, pool: torch.Tensor | None = None) -> torch.Tensor:
    """The fused launch against the unfused pair on two copies of `pool` (the case's by default):
    identical outputs and pools. Returns the fused output."""
    pool = case.pool if pool is None else pool
    pair_pool, fused_pool = pool.clone(), pool.clone()
    expected = case.unfused(pair_pool)
    got = case.fused(fused_pool)
    assert bit_identical(got, expected), (got.float() - expected.float()).abs().max()
    assert bit_identical(fused_pool, pair_pool), "the new K/V differ in place or bits"
    assert not bit_identical(fused_pool, pool), "the step wrote no K/V"
    return got


# (spec, heads, kv heads, window): Qwen3's prep (norm weight w rounded first, V as projected),
# Gemma 4 sliding's (V normalised, a window), Gemma 4 global's (V from raw K, proportional partial
# rotary), Gemma 3's (1 + w). Head dims 32 and 64, GQA 2 and 4.
SPECS = {
    "qwen3": (qwen3_prep(head_dim=32), 4, 2, None),
    "gemma4_sliding": (gemma4_sliding_prep(head_dim=32), 4, 1, 2 * SPLIT + 3),
    "gemma4_global": (gemma4_global_prep(head_dim=64), 4, 2, None),
    "gemma3": (gemma3_prep(head_dim=32), 2, 1, None),
}


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("name", ["qwen3", "gemma4_sliding"])
def test_the_fused_step_equals_prep_then_attention(name: str, dtype: torch.dtype) -> None:
    spec, heads, kv_heads, window = SPECS[name]
    assert_same_as_the_pair(Case(spec, heads, kv_heads, KV_LENS, dtype, window=window))


@pytest.mark.parametrize("name", ["gemma4_global", "gemma3"])
def test_the_other_prep_variants_equal_prep_then_attention(name: str) -> None:
    spec, heads, kv_heads, window = SPECS[name]
    assert_same_as_the_pair(
        Case(spec, heads, kv_heads, (1, SPLIT + 1, 3 * SPLIT + 7), torch.bfloat16, window=window, seed=4)
    )


def test_the_tensor_core_program_equals_prep_then_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's 16-bit program (q_rot cast to the storage dtype for the dot), run by the
    interpreter in fp16, whose 16-bit dot it gets right (tests/kernels/test_decode_attention.py)."""
    import kernels.triton.decode_attention as module

    monkeypatch.setattr(module, "uses_tensor_cores", lambda dtype: dtype != torch.float32)
    spec, heads, kv_heads, window = SPECS["qwen3"]
    assert_same_as_the_pair(Case(spec, heads, kv_heads, KV_LENS, torch.float16, seed=5))
    spec, heads, kv_heads, window = SPECS["gemma4_sliding"]
    assert_same_as_the_pair(Case(spec, heads, kv_heads, KV_LENS, torch.float16, window=window, seed=6))


def test_p_in_the_storage_dtype_equals_prep_then_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pv_storage` (P rounded for the P·V dot) in the fused launch and the pair alike, in fp16."""
    import kernels.triton.decode_attention as module

    monkeypatch.setattr(module, "uses_tensor_cores", lambda dtype: dtype != torch.float32)
    spec, heads, kv_heads, _ = SPECS["qwen3"]
    case = Case(spec, heads, kv_heads, KV_LENS, torch.float16, seed=5, pv_storage=True)
    rounded = assert_same_as_the_pair(case)
    case.pv_storage = False
    assert not bit_identical(rounded, case.fused(case.pool.clone())), "pv_storage changed nothing"


@pytest.mark.parametrize("window", [1, SPLIT, SPLIT + 5])
def test_sliding_windows_equal_prep_then_attention(window: int) -> None:
    spec, heads, kv_heads, _ = SPECS["gemma4_sliding"]
    lens = (1, window, window + 1, 2 * SPLIT + 3, PROGRAMS_PER_HEAD * SPLIT + 9)
    assert_same_as_the_pair(Case(spec, heads, kv_heads, lens, torch.bfloat16, window=window, seed=window))


def test_a_row_gets_the_same_bits_alone_as_in_the_batch() -> None:
    spec, heads, kv_heads, _ = SPECS["qwen3"]
    case = Case(spec, heads, kv_heads, KV_LENS, torch.bfloat16, seed=1)
    batch_pool = case.pool.clone()
    batch = case.fused(batch_pool)
    alone_pool = case.pool.clone()
    for r in range(len(KV_LENS)):
        assert bit_identical(case.fused(alone_pool, [r]), batch[r : r + 1]), KV_LENS[r]
    assert bit_identical(alone_pool, batch_pool)
    shuffled = [3, 5, 0, 4, 1, 2]
    assert bit_identical(case.fused(case.pool.clone(), shuffled), batch[shuffled])


def test_nothing_unreferenced_is_read_or_written() -> None:
    """NaN wherever no row may look: the output and the written K/V are those of the plain pool,
    and every NaN is still there bit for bit (only the new tokens' slots change)."""
    spec, heads, kv_heads, window = SPECS["gemma4_sliding"]
    case = Case(spec, heads, kv_heads, KV_LENS, torch.bfloat16, window=window, seed=2)
    sentinel = case.sentinel_pool()
    got = assert_same_as_the_pair(case, sentinel)
    assert torch.isfinite(got.float()).all()
    assert bit_identical(got, case.fused(case.pool.clone()))
    after = sentinel.clone()
    case.fused(after)
    new_slots = torch.zeros(case.pool.shape[1], PAGE_SIZE, dtype=torch.bool)
    for n, table in zip(case.kv_lens, case.tables, strict=True):
        new_slots[table[(n - 1) // PAGE_SIZE], (n - 1) % PAGE_SIZE] = True
    keep = ~new_slots.to(DEVICE)
    assert bit_identical(after[0], sentinel[0])
    assert bit_identical(after[1].transpose(1, 2)[keep], sentinel[1].transpose(1, 2)[keep])
    assert not bit_identical(after[1].transpose(1, 2)[~keep], sentinel[1].transpose(1, 2)[~keep])


def test_refuses_what_it_cannot_run_naming_the_value() -> None:
    spec, heads, kv_heads, _ = SPECS["qwen3"]
    case = Case(spec, heads, kv_heads, (SPLIT + 1,), torch.bfloat16)
    ops = case.operands()
    q, k, v, table, lens, positions = (
        ops[name] for name in ("q", "k", "v", "page_table", "kv_lens", "positions")
    )
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    assert isinstance(table, torch.Tensor) and isinstance(lens, torch.Tensor)
    assert isinstance(positions, torch.Tensor)
    pool = case.pool[1]

    def run(prep: PrepOperands, **changed: object) -> None:
        args: dict[str, object] = {"q": q, "k": k, "v": v, "layer": case.layer, **changed}
        decode_attention_with_prep(
            prep,
            args["q"],
            args["k"],
            args["v"],
            pool,
            table,
            lens,
            args["layer"],
            split_tokens=SPLIT,  # type: ignore[arg-type]
        )

    gated = qwen35_full_attention_prep(head_dim=32)
    with pytest.raises(DecodeAttentionError, match=r"qwen35_full has a gated Q \(q_gated=True\)"):
        run(PrepOperands(gated, case.q_norm_weight, case.k_norm_weight, case.rope_table, positions))
    with pytest.raises(DecodeAttentionError, match="head_dim=64 differs from the layer's head_dim=32"):
        run(
            PrepOperands(
                qwen3_prep(head_dim=64), case.q_norm_weight, case.k_norm_weight, case.rope_table, positions
            )
        )
    with pytest.raises(DecodeAttentionError, match="v is None"):
        run(case.prep(positions), v=None)
    with pytest.raises(
        DecodeAttentionError, match=r"positions must be 1-D with at least \d+ rows, got \(0,\)"
    ):
        run(case.prep(positions[:0]))
    with pytest.raises(DecodeAttentionError, match=r"torch\.float32"):
        run(case.prep(positions.float()))
    with pytest.raises(DecodeAttentionError, match=r"rope table .* torch\.float32"):
        run(PrepOperands(spec, case.q_norm_weight, case.k_norm_weight, case.rope_table.float(), positions))
    with pytest.raises(DecodeAttentionError, match=r"k_norm_weight must be \[32\], got \(16,\)"):
        run(PrepOperands(spec, case.q_norm_weight, case.k_norm_weight[:16], case.rope_table, positions))
    with pytest.raises(DecodeAttentionError, match=r"k \(1, 1, 32\) is not \[rows, 2, 32\]"):
        run(case.prep(positions), k=k[:, :1], v=v[:, :1])


def test_padding_rows_are_harmless() -> None:
    """A graph bucket's padding rows (kv_len 1, position 0, every page the padding page) behind live
    rows: the live rows' outputs and every page but the padding page are those of the live rows
    alone; the padding rows' outputs are finite. Positions in int64 here."""
    spec, heads, kv_heads, _ = SPECS["qwen3"]
    case = Case(spec, heads, kv_heads, (SPLIT + 1, 3 * SPLIT + 7), torch.bfloat16, seed=3)
    live_pool = case.pool.clone()
    live = case.fused(live_pool)
    ops = case.operands()
    q, k, v, table = ops["q"], ops["k"], ops["v"], ops["page_table"]
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    assert isinstance(table, torch.Tensor)
    padding = 3

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[:1].expand(padding, *t.shape[1:])])

    padded_table = torch.cat(
        [table, torch.full((padding, table.shape[1]), PADDING_PAGE, dtype=torch.int32, device=DEVICE)]
    )
    lens = torch.tensor([SPLIT + 1, 3 * SPLIT + 7] + [1] * padding, dtype=torch.int32, device=DEVICE)
    pool = case.pool.clone()
    out = decode_attention_with_prep(
        case.prep((lens - 1).long()),  # int64 positions, as PagedRows may hold
        pad(q),
        pad(k),
        pad(v),
        pool[1],
        padded_table,
        lens,
        case.layer,
        split_tokens=SPLIT,
    )
    assert bit_identical(out[:2], live)
    assert torch.isfinite(out[2:].float()).all()
    assert bit_identical(pool[0], live_pool[0])
    others = torch.arange(pool.shape[1], device=DEVICE) != PADDING_PAGE
    assert bit_identical(pool[1][others], live_pool[1][others])
