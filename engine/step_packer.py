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
    input_ids: list[int] = []
    positions: list[int] = []
    seq_index: list[int] = []
    logit_index: list[int] = []
    for i, row in enumerate(rows):
        input_ids.extend(row.token_ids)
        positions.extend(range(row.start_pos, row.end_pos))
        seq_index.extend([i] * len(row.token_ids))
        if row.sample:
            logit_index.append(len(input_ids) - 1)
    tokens = len(input_ids)
    input_ids.extend([_FILLER_TOKEN] * filler)
    positions.extend([0] * filler)
    seq_index.extend(range(len(rows), num_rows))
    if bucket is not None:
        logit_index.extend(range(tokens, tokens + filler))
    if logits_last is not None:
        logit_index = list(range(tokens - logits_last, tokens))

    q_lens = tuple(len(r.token_ids) for r in rows) + (1,) * filler
    kv_lens = tuple(r.end_pos for r in rows) + (1,) * filler
    tables: list[torch.Tensor] = []
    for g, spec in enumerate(specs):
        group_tables = tuple(r.page_tables[g] for r in rows) + ((PADDING_PAGE,),) * filler
        tables.append(_padded_table(group_tables))
        attention.plan(g, GroupBatch(q_lens, kv_lens, group_tables, PAGE_SIZE), spec, graph_bucket=bucket)
    positions_t = torch.tensor(positions, dtype=torch.int32)
    seq_index_t = torch.tensor(seq_index, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=positions_t,
        rows=tuple(PagedRows(positions_t, seq_index_t, table) for table in tables),
        sample_index=torch.tensor(logit_index, dtype=torch.long),
        attention=attention,
        state_slots=torch.tensor([r.state_slot for r in rows] + [PADDING_SLOT] * filler, dtype=torch.long),
    )


def _padded_table(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """int32 [rows, widest] with each row's pages, padded with the padding page. Filled through
    numpy: a nested list through torch.tensor costs several times more host time per step."""
    padded = np.full((len(tables), max(len(t) for t in tables)), PADDING_PAGE, dtype=np.int32)
    for i, table in enumerate(tables):
        padded[i, : len(table)] = table
    return torch.from_numpy(padded)
