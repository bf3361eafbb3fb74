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
from itertools import chain

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
    live = len(rows)
    # Per row first (one pass over the rows), then every per-token array in bulk through numpy.
    q_lens = tuple(len(r.token_ids) for r in rows) + (1,) * filler
    kv_lens = tuple(r.start_pos + len(r.token_ids) for r in rows) + (1,) * filler
    q_len = np.array(q_lens, dtype=np.int64)
    tokens = int(q_len[:live].sum())
    # Filler rows are one token each at position 0: a start of 0 and a q_len of 1 give exactly that.
    starts = np.zeros(num_rows, dtype=np.int64)
    starts[:live] = np.fromiter((r.start_pos for r in rows), dtype=np.int64, count=live)
    input_ids = np.full(tokens + filler, _FILLER_TOKEN, dtype=np.int64)
    input_ids[:tokens] = np.fromiter(chain.from_iterable(r.token_ids for r in rows), np.int64, tokens)
    ends = np.cumsum(q_len)  # one past each row's last token in the packed step
    seq_index = np.repeat(np.arange(num_rows, dtype=np.int32), q_len)
    positions = (np.arange(tokens + filler, dtype=np.int64) - np.repeat(ends - q_len - starts, q_len)).astype(
        np.int32
    )
    if logits_last is not None:
        logit_index = np.arange(tokens - logits_last, tokens, dtype=np.int64)
    else:
        samples = np.fromiter((r.sample for r in rows), dtype=bool, count=live)
        logit_index = ends[:live][samples] - 1
        if bucket is not None:
            logit_index = np.concatenate((logit_index, np.arange(tokens, tokens + filler, dtype=np.int64)))

    tables: list[torch.Tensor] = []
    for g, spec in enumerate(specs):
        group_tables = tuple(r.page_tables[g] for r in rows) + ((PADDING_PAGE,),) * filler
        tables.append(_padded_table(group_tables))
        attention.plan(g, GroupBatch(q_lens, kv_lens, group_tables, PAGE_SIZE), spec, graph_bucket=bucket)
    positions_t = torch.from_numpy(positions)
    seq_index_t = torch.from_numpy(seq_index)
    state_slots = np.full(num_rows, PADDING_SLOT, dtype=np.int64)
    state_slots[:live] = np.fromiter((r.state_slot for r in rows), dtype=np.int64, count=live)
    return ForwardBatch(
        input_ids=torch.from_numpy(input_ids),
        positions=positions_t,
        rows=tuple(PagedRows(positions_t, seq_index_t, table) for table in tables),
        sample_index=torch.from_numpy(logit_index),
        attention=attention,
        state_slots=torch.from_numpy(state_slots),
    )


def _padded_table(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """int32 [rows, widest] with each row's pages, padded with the padding page. Filled in one
    numpy scatter of the concatenated tables: a nested list through torch.tensor, or one numpy
    assignment per row, costs several times more host time per step."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    padded = np.full((len(tables), int(lengths.max())), PADDING_PAGE, dtype=np.int32)
    # Row-major order of the mask's True cells is each row's pages in order, rows in order.
    filled = np.arange(padded.shape[1]) < lengths[:, None]
    padded[filled] = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    return torch.from_numpy(padded)
