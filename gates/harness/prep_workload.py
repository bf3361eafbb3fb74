"""Synthetic attention-prep batches for the kernel tests, the GPU gates and the benchmark.

A batch looks like a real step: Q/K/V are strided views of one fused QKV projection, sequences
sit on shuffled (non-contiguous) pages, prefill chunks start mid-page and cross page boundaries,
decode rows sit at ragged positions, and filler rows point at the padding page. The pool starts
filled with a random sentinel pattern (never zeros) so untouched slots can be checked bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE, KVPoolLayout, pages_for
from kernels.reference import NormWeight, PagedRows, PrepSpec, rope_table


@dataclass(slots=True, frozen=True)
class SequenceRows:
    """``length`` consecutive rows of one sequence, the first at ``start_position``."""

    start_position: int
    length: int

    @property
    def end_position(self) -> int:
        return self.start_position + self.length


@dataclass(slots=True, frozen=True)
class PrepBatch:
    """Everything one prep launch reads and writes, for ``rows.rows`` rows starting at ``row_offset``."""

    spec: PrepSpec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None
    q_norm_weight: torch.Tensor
    k_norm_weight: torch.Tensor
    rows: PagedRows
    rope_table: torch.Tensor
    pool: torch.Tensor
    layer: int
    q_out: torch.Tensor
    gate_out: torch.Tensor | None
    row_offset: int = 0
    filler_rows: int = 0

    @property
    def num_rows(self) -> int:
        """Rows the launch processes (those before ``row_offset`` are not part of the batch)."""
        return self.rows.rows - self.row_offset

    @property
    def pool_layer(self) -> torch.Tensor:
        return self.pool[self.layer]

    def clone(self) -> PrepBatch:
        """Independent copies of everything written (pool and outputs); inputs are shared."""
        return replace(
            self,
            pool=self.pool.clone(),
            q_out=self.q_out.clone(),
            gate_out=None if self.gate_out is None else self.gate_out.clone(),
        )


def _norm_weight(spec_weight: NormWeight, head_dim: int, generator: torch.Generator) -> torch.Tensor:
    noise = 0.3 * torch.randn(head_dim, generator=generator)
    # Gemma and Qwen3 store the multiplier itself (around 1); Qwen3.5 stores its offset from 1.
    return noise if spec_weight is NormWeight.ONE_PLUS_W else 1.0 + noise


def _sentinel_like(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * 3.0 + 7.0).to(dtype)


def build_batch(
    spec: PrepSpec,
    q_heads: int,
    kv_heads: int,
    sequences: list[SequenceRows],
    *,
    filler_rows: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    layers: int = 2,
    spare_pages: int = 3,
) -> PrepBatch:
    """A batch of the given sequences (in order) followed by ``filler_rows`` padding rows.

    Inputs are drawn in fp32 with a different scale per head (so rounding is exercised across
    exponents) and stored in ``dtype``; the pool layer written is the last of ``layers``.
    """
    generator = torch.Generator().manual_seed(seed)
    head_dim = spec.head_dim
    # Only the pages a sequence's rows touch get their own ids; the entries in front of them are
    # junk ids of other pages, which a correct kernel never reads (a wrong one would write there).
    first_pages = [seq.start_position // PAGE_SIZE for seq in sequences]
    end_pages = [pages_for(seq.end_position) for seq in sequences]
    touched = [end - first for first, end in zip(first_pages, end_pages, strict=True)]
    total_pages = 1 + sum(touched) + spare_pages
    page_ids = (torch.randperm(total_pages - 1, generator=generator) + 1).to(torch.int32)
    max_pages = max([*end_pages, 1])
    page_table = torch.randint(1, total_pages, (len(sequences) + 1, max_pages), generator=generator).to(
        torch.int32
    )
    cursor = 0
    for seq_number, (first, count) in enumerate(zip(first_pages, touched, strict=True)):
        page_table[seq_number, first : first + count] = page_ids[cursor : cursor + count]
        cursor += count
    padding_seq = len(sequences)
    page_table[padding_seq] = PADDING_PAGE

    positions: list[int] = []
    seq_index: list[int] = []
    for seq_number, seq in enumerate(sequences):
        positions.extend(range(seq.start_position, seq.end_position))
        seq_index.extend([seq_number] * seq.length)
    for filler in range(filler_rows):
        positions.append(filler % PAGE_SIZE)
        seq_index.append(padding_seq)
    num_rows = len(positions)

    q_width = spec.q_width
    width = q_heads * q_width + kv_heads * head_dim * (2 if spec.takes_v else 1)
    head_scales = torch.exp2(torch.randint(-3, 6, (1, width // head_dim, 1), generator=generator).float())
    qkv = (torch.randn(num_rows, width // head_dim, head_dim, generator=generator) * head_scales).reshape(
        num_rows, width
    )
    qkv = qkv.to(dtype).to(device)
    q = qkv[:, : q_heads * q_width].view(num_rows, q_heads, q_width)
    k_end = q_heads * q_width + kv_heads * head_dim
    k = qkv[:, q_heads * q_width : k_end].view(num_rows, kv_heads, head_dim)
    v = qkv[:, k_end:].view(num_rows, kv_heads, head_dim) if spec.takes_v else None

    max_position = max([*positions, 0])
    layout = KVPoolLayout(layers=layers, pages=total_pages, kv_heads=kv_heads, head_dim=head_dim)
    pool = _sentinel_like(layout.shape, dtype, generator).to(device)
    q_out = _sentinel_like((num_rows, q_heads, head_dim), dtype, generator).to(device)
    gate_out = (
        _sentinel_like((num_rows, q_heads, head_dim), dtype, generator).to(device) if spec.q_gated else None
    )
    return PrepBatch(
        spec=spec,
        q=q,
        k=k,
        v=v,
        q_norm_weight=_norm_weight(spec.q_norm.weight, head_dim, generator).to(dtype).to(device),
        k_norm_weight=_norm_weight(spec.k_norm.weight, head_dim, generator).to(dtype).to(device),
        rows=PagedRows(
            positions=torch.tensor(positions, dtype=torch.int32, device=device),
            seq_index=torch.tensor(seq_index, dtype=torch.int32, device=device),
            page_table=page_table.to(device),
        ),
        rope_table=rope_table(spec.rope, max_position + 1, dtype, device),
        pool=pool,
        layer=layers - 1,
        q_out=q_out,
        gate_out=gate_out,
        filler_rows=filler_rows,
    )


def mixed_sequences(num_rows: int, seed: int = 0) -> tuple[list[SequenceRows], int]:
    """A mixed prefill + decode layout of ``num_rows`` rows: ``(sequences, filler_rows)``.

    Up to 3 rows: decode rows only. Otherwise one filler row at the end, decode rows at ragged
    positions (one on a page's last slot, one on a page's first) and, from 8 rows on, a prefill
    chunk that starts mid-page, crosses a page boundary and ends on a partial last page, taking
    half the rows or more.
    """
    generator = torch.Generator().manual_seed(seed)
    if num_rows <= 3:
        return [SequenceRows(int(p), 1) for p in torch.randint(0, 4096, (num_rows,), generator=generator)], 0
    filler_rows = 1
    budget = num_rows - filler_rows
    sequences: list[SequenceRows] = []
    if num_rows >= 8:
        chunk = max(budget // 2, budget - 64)
        sequences.append(SequenceRows(start_position=PAGE_SIZE * 3 + 13, length=chunk))
        budget -= chunk
    edge_positions = [PAGE_SIZE * 2 - 1, PAGE_SIZE * 5]
    for i in range(budget):
        position = (
            edge_positions[i]
            if i < len(edge_positions)
            else int(torch.randint(0, 4096, (1,), generator=generator))
        )
        sequences.append(SequenceRows(position, 1))
    return sequences, filler_rows


def with_row_offset(batch: PrepBatch, seed: int = 1) -> PrepBatch:
    """The same batch shifted down one row: a junk row in front of every per-row buffer.

    The junk row has its own junk page-table row (prepended, pointing at real pages, so a stray
    write would land in the pool) and a sentinel output row; the launch starts at row 1.
    """
    generator = torch.Generator().manual_seed(seed)
    device = batch.q.device

    def prepend(t: torch.Tensor) -> torch.Tensor:
        junk = (torch.randn((1, *t.shape[1:]), generator=generator) * 5.0).to(t.dtype).to(device)
        return torch.cat((junk, t), dim=0)

    rows = batch.rows
    pages = batch.pool.shape[1]
    junk_table_row = torch.randint(1, pages, (1, rows.page_table.shape[1]), generator=generator).to(
        torch.int32
    )
    page_table = torch.cat((junk_table_row.to(device), rows.page_table), dim=0)
    junk_position = torch.tensor([3], dtype=rows.positions.dtype, device=device)
    shifted_rows = PagedRows(
        positions=torch.cat((junk_position, rows.positions)),
        seq_index=torch.cat((torch.zeros_like(rows.seq_index[:1]), rows.seq_index + 1)),
        page_table=page_table,
    )
    return replace(
        batch,
        q=prepend(batch.q),
        k=prepend(batch.k),
        v=None if batch.v is None else prepend(batch.v),
        rows=shifted_rows,
        q_out=prepend(batch.q_out),
        gate_out=None if batch.gate_out is None else prepend(batch.gate_out),
        pool=batch.pool.clone(),
        row_offset=batch.row_offset + 1,
    )


def addressed_slot_mask(batch: PrepBatch, slots: torch.Tensor) -> torch.Tensor:
    """bool ``[pages, 16]``: the slots of the written layer that the given flat slots address."""
    pages = batch.pool.shape[1]
    mask = torch.zeros(pages * PAGE_SIZE, dtype=torch.bool, device=slots.device)
    mask[slots] = True
    return mask.view(pages, PAGE_SIZE)
