"""The one place a step's rows become tensors: token ids, positions, page tables, logit rows.

Every forward packs here — eager steps, graphed decode, start-up's profiling steps and the gates'
scoring prefill — and plans the attention backend for each KV group in the same call, so page
tables are padded and attention is planned one way.

Filler rows (a CUDA-graph bucket's rows past the live ones) are token 0 at position 0 with every
page-table entry the padding page: they write only page 0 and attend to one token there
(kernels/kv_layout.py). A per-request state slot (recurrent models) would be one more per-row field
of `ForwardBatch` (`state_slots`), filled here, filler rows taking slot 0, the padding slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, chain

import numpy as np
import torch

from engine.forward_batch import ForwardBatch
from engine.kv.state_pool import PADDING_SLOT
from engine.runner import BatchRow
from kernels.attention.base import AttentionBackend, AttentionLayerSpec, GroupBatch
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE
from kernels.reference import PagedRows

_FILLER_TOKEN = 0
# One object, so a filler row's table is the same from step to step (`PageTableCache`).
_FILLER_TABLE = (PADDING_PAGE,)


def pack_step(
    rows: Sequence[BatchRow],
    specs: Sequence[AttentionLayerSpec],
    attention: AttentionBackend,
    *,
    bucket: int | None = None,
    logits_last: int | None = None,
    table_cache: PageTableCache | None = None,
) -> ForwardBatch:
    """The step's `ForwardBatch` on the host (`.to(device)` moves it), with `attention` planned for
    each KV group (`specs[g]` is group g's geometry).

    `bucket`: a decode step padded with filler rows to exactly that many rows and planned into the
    bucket's graph buffers. `logits_last=n`: the step's last n tokens get logits (a whole-prompt
    scoring or profiling prefill); by default one per row that samples, its last token.
    `table_cache`: the padded page tables are built from the last step packed through it."""
    num_rows = len(rows) if bucket is None else bucket
    if num_rows < len(rows):
        raise ValueError(f"{len(rows)} rows do not fit bucket {bucket}")
    filler = num_rows - len(rows)
    # One pass over the rows per field (filler rows: one token at position 0, so kv_len 1). Lists
    # become tensors through numpy, at a third of `torch.tensor`'s cost; array arithmetic is kept
    # to multi-token steps, where it replaces per-token loops (at a few rows it costs more than it
    # saves).
    q_lens = tuple([len(r.token_ids) for r in rows]) + (1,) * filler
    starts = [r.start_pos for r in rows] + [0] * filler
    kv_lens = tuple([start + q for start, q in zip(starts, q_lens, strict=True)])
    one_token_rows = max(q_lens) == 1
    if one_token_rows:
        # Every row is one token (a decode step): token i is row i's, at the row's start.
        input_ids = [r.token_ids[0] for r in rows]
        ends: Sequence[int] = range(1, num_rows + 1)
        positions = torch.from_numpy(np.array(starts, dtype=np.int32))
        seq_index = torch.arange(num_rows, dtype=torch.int32)
    else:
        # Token j of row r sits at position start_r + (j - first_r), where first_r = end_r - q_r.
        input_ids = list(chain.from_iterable(r.token_ids for r in rows))
        ends = list(accumulate(q_lens))  # one past each row's last token in the packed step
        q_len = np.array(q_lens, dtype=np.int64)
        offset = np.repeat(np.array(ends, dtype=np.int64) - q_len - np.array(starts, dtype=np.int64), q_len)
        positions = torch.from_numpy((np.arange(ends[-1], dtype=np.int64) - offset).astype(np.int32))
        seq_index = torch.from_numpy(np.repeat(np.arange(num_rows, dtype=np.int32), q_len))
    tokens = len(input_ids)
    input_ids.extend([_FILLER_TOKEN] * filler)
    if logits_last is not None:
        logit_index = list(range(tokens - logits_last, tokens))
    else:
        # A row that samples: its last token; filler rows of a bucket each have a logit row too.
        logit_index = [end - 1 for end, row in zip(ends[: len(rows)], rows, strict=True) if row.sample]
        if bucket is not None:
            logit_index.extend(range(tokens, tokens + filler))

    tables: list[torch.Tensor] = []
    for g, spec in enumerate(specs):
        group_tables = tuple([r.page_tables[g] for r in rows]) + (_FILLER_TABLE,) * filler
        tables.append(
            _padded_table(group_tables) if table_cache is None else table_cache.padded(g, group_tables)
        )
        attention.plan(g, GroupBatch(q_lens, kv_lens, group_tables, PAGE_SIZE), spec, graph_bucket=bucket)
    return ForwardBatch(
        input_ids=_longs(input_ids),
        positions=positions,
        rows=tuple(PagedRows(positions, seq_index, table) for table in tables),
        sample_index=_longs(logit_index),
        attention=attention,
        state_slots=_longs([r.state_slot for r in rows] + [PADDING_SLOT] * filler),
        cu_seqlens=None if one_token_rows else (0, *ends),
    )


def _longs(values: list[int]) -> torch.Tensor:
    """int64 [len(values)] on the host, through numpy (a third of `torch.tensor`'s cost)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _padded_table(tables: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """int32 [rows, widest] with each row's pages, padded with the padding page."""
    return torch.from_numpy(_padded_array(tables))


def _padded_array(tables: Sequence[tuple[int, ...]], width: int | None = None) -> np.ndarray:
    """`_padded_table` in numpy, `width` columns (default: the widest table's). Filled by one pass
    over the padded rows: a nested list through torch.tensor, or one numpy assignment per row,
    costs several times more host time per step; even so each page id costs about 20 ns on the CPU
    box (docs/benchmarks/host-cpu.md), hence `PageTableCache`."""
    if width is None:
        width = max(map(len, tables))
    padded = (table + (PADDING_PAGE,) * (width - len(table)) for table in tables)
    flat = np.fromiter(chain.from_iterable(padded), dtype=np.int32, count=len(tables) * width)
    return flat.reshape(len(tables), width)


class PageTableCache:
    """Each KV group's padded page table of the last step packed through it, so that the next step
    converts only the rows whose table changed.

    A request's page table is one tuple object from step to step until it changes (the KV manager
    keeps it: `KVManager.page_tables`), and a decode step's rows are mostly the last step's, in the
    same order. So row i is copied from the last array when its table is the same object as last
    step's row i (a tuple is immutable: the same object holds the same pages), and converted from
    its tuple otherwise (all such rows in one pass); a step with another row count or width is
    converted whole. The result is always `_padded_table(tables)`; every call returns a new array,
    so a tensor handed out earlier never changes under a step still reading it."""

    def __init__(self) -> None:
        # Per group: the tables of the last step (kept alive, so `is` compares real objects) and
        # its padded array.
        self._last: dict[int, tuple[Sequence[tuple[int, ...]], np.ndarray]] = {}

    def padded(self, group: int, tables: Sequence[tuple[int, ...]]) -> torch.Tensor:
        last = self._last.get(group)
        width = max(map(len, tables))
        if last is None or last[1].shape != (len(tables), width):
            array = _padded_array(tables)
        else:
            last_tables, last_array = last
            array = last_array.copy()
            changed = [
                i for i, (t, last_t) in enumerate(zip(tables, last_tables, strict=True)) if t is not last_t
            ]
            if changed:
                # In one pass, however many: a tensor-parallel worker's rows are unpickled anew
                # every step, so none of its tables is the last step's object.
                array[changed] = _padded_array([tables[i] for i in changed], width)
        self._last[group] = (tables, array)
        return torch.from_numpy(array)
