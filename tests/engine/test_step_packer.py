"""engine.step_packer builds a step's per-token arrays in bulk (numpy); these tests hold it to the
plain per-row definition: row by row, each row's tokens, positions start_pos.., its row index, a
logit for its last token when it samples; filler rows token 0 at position 0 with the padding page."""

from __future__ import annotations

import random

import torch

from engine.contract import SamplingParams
from engine.runner import BatchRow
from engine.step_packer import PageTableCache, _padded_table, pack_step
from kernels.attention.base import AttentionLayerSpec, GroupBatch
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE, pages_for

SPEC = AttentionLayerSpec(num_heads=2, num_kv_heads=1, head_dim=8, scale=0.5)


class _RecordingAttention:
    """Keeps what each group was planned with (the packer's other output)."""

    def __init__(self) -> None:
        self.plans: dict[int, tuple[GroupBatch, int | None]] = {}

    def plan(
        self, group: int, batch: GroupBatch, layer: AttentionLayerSpec, graph_bucket: int | None = None
    ) -> None:
        self.plans[group] = (batch, graph_bucket)


def _rows(seed: int, count: int, groups: int) -> list[BatchRow]:
    """Prefill chunks, decode rows and non-sampling chunks, with distinct page tables per group."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        start = rng.choice([0, 16, 37, 500])
        length = rng.choice([1, 1, 3, 17])
        end = start + length
        tables = tuple(
            tuple(rng.randrange(1, 5000) for _ in range(pages_for(end) + rng.choice([0, 0, 2])))
            for _ in range(groups)
        )
        tokens = tuple(rng.randrange(0, 30000) for _ in range(length))
        rows.append(
            BatchRow(
                f"r{i}",
                tokens,
                start,
                tables,
                rng.random() < 0.7,
                SamplingParams(),
                tokens,
                0,
                state_slot=i + 1,
            )
        )
    return rows


def _plain(
    rows: list[BatchRow], groups: int, bucket: int | None, logits_last: int | None
) -> dict[str, object]:
    num_rows = len(rows) if bucket is None else bucket
    input_ids: list[int] = []
    positions: list[int] = []
    seq_index: list[int] = []
    logits: list[int] = []
    for i, row in enumerate(rows):
        for j, token in enumerate(row.token_ids):
            input_ids.append(token)
            positions.append(row.start_pos + j)
            seq_index.append(i)
        if row.sample:
            logits.append(len(input_ids) - 1)
    tokens = len(input_ids)
    for i in range(len(rows), num_rows):
        input_ids.append(0)
        positions.append(0)
        seq_index.append(i)
        if bucket is not None:
            logits.append(len(input_ids) - 1)
    if logits_last is not None:
        logits = list(range(tokens - logits_last, tokens))
    tables = []
    for g in range(groups):
        group_tables = [list(r.page_tables[g]) for r in rows] + [[PADDING_PAGE]] * (num_rows - len(rows))
        width = max(len(t) for t in group_tables)
        tables.append([t + [PADDING_PAGE] * (width - len(t)) for t in group_tables])
    return {
        "input_ids": input_ids,
        "positions": positions,
        "seq_index": seq_index,
        "sample_index": logits,
        "tables": tables,
        "state_slots": [r.state_slot for r in rows] + [0] * (num_rows - len(rows)),
    }


def _check(
    rows: list[BatchRow], groups: int, bucket: int | None = None, logits_last: int | None = None
) -> None:
    attention = _RecordingAttention()
    step = pack_step(rows, [SPEC] * groups, attention, bucket=bucket, logits_last=logits_last)  # type: ignore[arg-type]
    want = _plain(rows, groups, bucket, logits_last)
    assert step.input_ids.dtype == torch.long and step.input_ids.tolist() == want["input_ids"]
    assert step.positions.dtype == torch.int32 and step.positions.tolist() == want["positions"]
    assert step.sample_index.dtype == torch.long and step.sample_index.tolist() == want["sample_index"]
    assert step.state_slots is not None and step.state_slots.dtype == torch.long
    assert step.state_slots.tolist() == want["state_slots"]
    assert len(step.rows) == groups
    for g, paged in enumerate(step.rows):
        assert paged.seq_index.dtype == torch.int32 and paged.seq_index.tolist() == want["seq_index"]
        assert paged.page_table.dtype == torch.int32 and paged.page_table.tolist() == want["tables"][g]  # type: ignore[index]
        planned, planned_bucket = attention.plans[g]
        num_rows = len(rows) if bucket is None else bucket
        filler = num_rows - len(rows)
        assert planned_bucket == bucket and planned.page_size == PAGE_SIZE
        assert planned.q_lens == tuple(len(r.token_ids) for r in rows) + (1,) * filler
        assert planned.kv_lens == tuple(r.end_pos for r in rows) + (1,) * filler
        assert planned.page_tables == tuple(r.page_tables[g] for r in rows) + ((PADDING_PAGE,),) * filler


def test_mixed_rows_match_the_per_row_definition() -> None:
    for seed in range(20):
        groups = 1 + seed % 3
        _check(_rows(seed, count=1 + seed % 9, groups=groups), groups=groups)


def test_decode_bucket_with_filler_rows_matches_the_per_row_definition() -> None:
    for seed in range(10):
        rows = [r for r in _rows(seed, count=6, groups=2)]
        decodes = [
            BatchRow(
                r.request_id,
                r.token_ids[:1],
                r.start_pos,
                r.page_tables,
                True,
                r.sampling,
                r.context,
                1,
                r.state_slot,
            )
            for r in rows
        ]
        _check(decodes, groups=2, bucket=8)
        _check(decodes, groups=2, bucket=6)


def test_scoring_prefill_logits_last_matches_the_per_row_definition() -> None:
    row = BatchRow.whole_prompt("score", tuple(range(40)), ((1, 2, 3),))
    _check([row], groups=1, logits_last=40)
    _check(_rows(3, count=4, groups=1), groups=1, logits_last=1)


def test_no_sampling_row_gives_an_empty_sample_index() -> None:
    rows = [
        BatchRow("a", (5, 6, 7), 0, ((9,),), False, SamplingParams(), (5, 6, 7), 0),
        BatchRow("b", (8,), 32, ((1, 2, 3),), False, SamplingParams(), (8,), 0),
    ]
    _check(rows, groups=1)
    assert pack_step(rows, [SPEC], _RecordingAttention()).sample_index.shape == (0,)  # type: ignore[arg-type]


def test_page_table_cache_matches_the_whole_conversion_step_after_step() -> None:
    """`PageTableCache` reuses the last step's rows whose table is the same tuple object; whatever
    changes between steps (a page added, a row gone or new, rows reordered, the same pages in a
    new tuple, the width), each step's table is the whole conversion's, and a tensor handed out
    earlier is never changed by a later step."""
    rng = random.Random(7)
    cache = PageTableCache()
    tables = [tuple(rng.randrange(1, 5000) for _ in range(rng.randrange(1, 6))) for _ in range(8)]
    handed_out: list[tuple[torch.Tensor, list[list[int]]]] = []
    for _ in range(200):
        change = rng.random()
        if change < 0.3:  # a row's table grows by a page (a new tuple)
            i = rng.randrange(len(tables))
            tables[i] = (*tables[i], rng.randrange(1, 5000))
        elif change < 0.4 and len(tables) > 1:  # a request finishes
            tables.pop(rng.randrange(len(tables)))
        elif change < 0.5:  # a request joins
            tables.insert(rng.randrange(len(tables) + 1), (rng.randrange(1, 5000),))
        elif change < 0.55:  # the same pages in another tuple object
            i = rng.randrange(len(tables))
            tables[i] = tuple(list(tables[i]))
        elif change < 0.6:  # a sliding window releases a row's first page (same length)
            i = rng.randrange(len(tables))
            tables[i] = (PADDING_PAGE, *tables[i][1:])
        elif change < 0.65:
            rng.shuffle(tables)
        step = tuple(tables)
        got = cache.padded(0, step)
        want = _padded_table(step)
        assert got.dtype == torch.int32 and torch.equal(got, want)
        handed_out.append((got, got.tolist()))
    assert all(tensor.tolist() == values for tensor, values in handed_out)


def test_pack_step_through_a_table_cache_matches_the_per_row_definition() -> None:
    cache = PageTableCache()
    rows = _rows(11, count=6, groups=2)
    for step in range(6):
        attention = _RecordingAttention()
        packed = pack_step(rows, [SPEC] * 2, attention, table_cache=cache)  # type: ignore[arg-type]
        want = _plain(rows, 2, None, None)
        for g in range(2):
            assert packed.rows[g].page_table.tolist() == want["tables"][g]  # type: ignore[index]
        # Next step: one row's tables grow by a page, the others are the same objects.
        grown = rows[step % len(rows)]
        rows[step % len(rows)] = BatchRow(
            grown.request_id,
            grown.token_ids,
            grown.start_pos,
            tuple((*t, 4000 + step) for t in grown.page_tables),
            grown.sample,
            grown.sampling,
            grown.context,
            grown.num_generated,
            grown.state_slot,
        )
