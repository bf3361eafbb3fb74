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


def pack_step(
    rows: Sequence[BatchRow],
    specs: Sequence[AttentionLayerSpec],
    attention: AttentionBackend,
    *,
    bucket: int | None = None,
    logits_last: int | None = None,
) -> ForwardBatch:
    """The step's `ForwardBatch` on the host (`.to(device)` moves it), with `attention` planned for
    each KV group (`specs[g]` is group g's geometry).

    `bucket`: a decode step padded with filler rows to exactly that many rows and planned into the
    bucket's graph buffers. `logits_last=n`: the step's last n tokens get logits (a whole-prompt
    scoring or profiling prefill); by default one per row that samples, its last token."""
    num_rows = len(rows) if bucket is None else bucket
    if num_rows < len(rows):
        raise ValueError(f"{len(rows)} rows do not fit bucket {bucket}")
    filler = num_rows - len(rows)
    # Per row once (filler rows: one token, position 0, so kv_len 1), then the per-token arrays.
    q_lens = tuple(len(r.token_ids) for r in rows) + (1,) * filler
    starts = [r.start_pos for r in rows] + [0] * filler
    kv_lens = tuple(start + q for start, q in zip(starts, q_lens, strict=True))
    input_ids = [*chain.from_iterable(r.token_ids for r in rows), *([_FILLER_TOKEN] * filler)]
    tokens = len(input_ids) - filler
    ends = list(accumulate(q_lens))  # one past each row's last token in the packed step
    one_token_rows = max(q_lens) == 1
    if one_token_rows:
        # Every row is one token (a decode step): token i is row i's, at the row's start.
        positions = torch.tensor(starts, dtype=torch.int32)
        seq_index = torch.arange(num_rows, dtype=torch.int32)
    else:
        # Token j of row r sits at position start_r + (j - first_r), where first_r = end_r - q_r.
        q_len = np.array(q_lens, dtype=np.int64)
        offset = np.repeat(np.array(ends, dtype=np.int64) - q_len - np.array(starts, dtype=np.int64), q_len)
        positions = torch.from_numpy((np.arange(len(input_ids), dtype=np.int64) - offset).astype(np.int32))
        seq_index = torch.from_numpy(np.repeat(np.arange(num_rows, dtype=np.int32), q_len))
    if logits_last is not None:
        logit_index = list(range(tokens - logits_last, tokens))
    else:
        logit_index = [end - 1 for end, row in zip(ends[: len(rows)], rows, strict=True) if row.sample]
        if bucket is not None:
            logit_index.extend(range(tokens, tokens + filler))

    tables: list[torch.Tensor] = []
    for g, spec in enumerate(specs):
        group_tables = tuple(r.page_tables[g] for r in rows) + ((PADDING_PAGE,),) * filler
        tables.append(_padded_table(group_tables))
        attention.plan(g, GroupBatch(q_lens, kv_lens, group_tables, PAGE_SIZE), spec, graph_bucket=bucket)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=positions,
        rows=tuple(PagedRows(positions, seq_index, table) for table in tables),
        sample_index=torch.tensor(logit_index, dtype=torch.long),
        attention=attention,
        state_slots=torch.tensor([r.state_slot for r in rows] + [PADDING_SLOT] * filler, dtype=torch.long),
        cu_seqlens=None if one_token_rows else (0, *ends),
    )


def _padded_table(tables: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """int32 [rows, widest] with each row's pages, padded with the padding page. Filled by one
    numpy pass over the padded rows: a nested list through torch.tensor, or one numpy assignment
    per row, costs several times more host time per step."""
    width = max(map(len, tables))
    padded = (table + (PADDING_PAGE,) * (width - len(table)) for table in tables)
    flat = np.fromiter(chain.from_iterable(padded), dtype=np.int32, count=len(tables) * width)
    return torch.from_numpy(flat.reshape(len(tables), width))
