"""The vocabulary-parallel pieces every sharded line shares: the embedding lookup over a rank's rows
of the table, and the LM head whose column slices meet on rank 0."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.parallel.group import RankGroup
from engine.parallel.sharding import Span


def vocab_parallel_embedding(
    input_ids: torch.Tensor, table: torch.Tensor, vocab: Span, group: RankGroup
) -> torch.Tensor:
    """Rows of the full table for `input_ids`, from each rank's `table` (the rows `vocab` names):
    a rank contributes the ids it holds and zeros elsewhere, and the sum over ranks is exact."""
    if group.size == 1:
        return F.embedding(input_ids, table)
    local = input_ids - vocab.start
    outside = (local < 0) | (local >= vocab.size)
    rows = F.embedding(local.masked_fill(outside, 0), table)
    rows.masked_fill_(outside.unsqueeze(-1), 0)
    return group.all_reduce(rows)


def vocab_parallel_logits(
    hidden: torch.Tensor,
    head: torch.Tensor,
    group: RankGroup,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """Float32 logits over the full vocabulary on rank 0 (rank order is vocabulary order); the other
    ranks get an empty [rows, 0]. Only the rows that sample reach here."""
    return group.gather_columns(linear(hidden, head)).float()
